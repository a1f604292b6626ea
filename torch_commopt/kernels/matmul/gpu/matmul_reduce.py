"""GPU schedules of matmul + reduce-scatter and matmul + all-reduce.

matmul_rs (rank r of W; segment p = the rows rank p keeps; buffer half h, alternating):
  before its first write that peer p will read, r takes the (h, p) token (p has finished
  its reads of the last half-h call; see symm); the fused kernel, whose tile counters are
  reset per call, also passes a barrier ->
  the peers' segments in the order r+1, r+2, ... (each peer first computes what r needs):
    direct:  cuBLAS writes piece c of segment p straight into p's receive slot r
             (NVLink stores), then sets p.DATA[h, r, c] = 1 (a fenced stream write);
    ce_push: cuBLAS writes into a local staging tensor; the side stream copies each
             piece to p's slot r with the copy engine, then flags it;
    ce_pull: cuBLAS writes into this rank's own buffer, slot p (local stores), then
             flags p; p's local copy stream pulls the piece with its copy engine straight
             into p's output, and p's own GEMM adds into it in place (addmm_: no C copy);
    fused:   one persistent Triton GEMM does all segments, releasing per-piece tile
             counters (see triton_kernels.rs_gemm_kernel);
  then the own segment, piece by piece after the peers' flags, with the reduction fused
  into the GEMM's epilogue (the Triton epilogue; with cuBLAS at W = 2 a second copy
  stream moves the received partial into the output as it lands and the GEMM adds in
  place, addmm_, but ce_push:1 runs the own GEMM first and adds the partial after it; at
  W > 2 the own GEMM writes its piece into this rank's own receive slot before the waits,
  and the W slots are summed in one fp32-accumulating pass; a float8 product (kernels/scaled.py)
  takes that path at W = 2 too: _scaled_mm cannot add into its output).
matmul_ar = the same reduce-scatter of row blocks, then the reduced pieces are pushed
to every peer by the copy engine (flags DATA2, side stream) and copied into place there
(local copy stream, but for fused).
K parts (ops.k_parts: t = a @ w + sum_i a_i @ w_i, a concat-K sum left unconcatenated): each
piece's product is one GEMM per part, the later ones adding into the first's output in place
(addmm_, beta 1); `fused` multiplies them concatenated (one copy of each operand per call).
At the end a rank lowers the DATA flags it waited for and gives its sources their tokens
back.  Every flag value is a constant, so the calls (but `fused`, whose barrier counts
epochs) can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import call_graphs, driver, symm
from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS, data_index
from torch_commopt.kernels.matmul.gpu import sm90, tma
from torch_commopt.kernels.matmul.gpu.layout import RowLayout, as_blocks, blocks_of, cdiv, piece_rows
from torch_commopt.kernels.matmul.product import Product
from torch_commopt.kernels.scaled import Expanded, Scaled, add_matmul_, call_key, matmul, out_dtype

FUSED_DEFAULTS = {"bm": 128, "bn": 256, "bk": 64, "gm": 8, "warps": 8, "stages": 3, "store": "direct"}
log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()


def pull_placed(sched: Schedule, world: int, op: str) -> Schedule:
    """What runs for `sched` over `world` ranks (Schedule.at_world: ce_pull over two ranks only),
    logged once where that is another schedule.  A third rank may still be pulling bytes of a
    peer's half left by a ce_pull of another shape (a replayed graph takes no new half, so the
    eager call after it shares the replay's), under a token no writer into that half waits for
    (tests/kernels/test_flex_ce_protocol.py)."""
    alt = sched.at_world(world)
    if alt != sched and (op, str(sched)) not in _said:
        _said.add((op, str(sched)))
        log.info("commopt %s: schedule %s over %d ranks runs %s (a third rank's pulls are guarded by no token "
                 "a writer holds)", op, sched, world, alt)
    return alt


# What launch_rs_fused takes beside A and B, in three values (NamedTuples: built on every call,
# at a fraction of a frozen dataclass's host cost).
class RsTargets(NamedTuple):
    """Where the fused reduce-scatter GEMM writes and reads: out (m_seg, N) this rank's reduced
    segment; the peers' segments go to recv_bases[p] + recv_off (elements; direct=True: stores
    into the peer's receive slot) or to send[p] (direct=False: a local staging tensor (world,
    m_seg, N) the copy engine ships); recv (world, m_seg, N): this rank's receive slots, where
    the partials land; recv_bases: (world,) int64 device addresses of every rank's buffer;
    bases_aligned: every recv_bases entry is 16-byte aligned (the direct stores are then
    vectorized when the slot offsets are too); host_bases: the same addresses on the host (the
    sm_90a kernel's tensor maps of the peers' slots are encoded there; empty: not known)."""

    out: torch.Tensor
    send: torch.Tensor
    recv: torch.Tensor
    recv_bases: torch.Tensor
    recv_off: int
    direct: bool
    bases_aligned: bool
    host_bases: Sequence[int] = ()


class RsSignals(NamedTuple):
    """The flags the fused reduce-scatter GEMM counts its tiles into and waits on: flags (this
    rank's), flag_bases ((world,) int64 device addresses of every rank's flags), status (where a
    debug wait reports), data_base (the index of this call's half's DATA flags, symm.data_index)
    and epoch (the value a landed piece's DATA flag holds)."""

    flags: torch.Tensor
    flag_bases: torch.Tensor
    status: torch.Tensor
    data_base: int
    epoch: int = 1


class RsSegments(NamedTuple):
    """How the fused reduce-scatter GEMM's rows split: this rank is `rank` of `world`; A's
    world * m_seg rows come in runs of `lin` per segment (RowLayout.lin); a segment's pieces are
    chunk_mt M tiles each."""

    rank: int
    world: int
    lin: int
    m_seg: int
    chunk_mt: int


def unsupported_reason(a, weight, scatter_dim: int | None, world: int, schedule: Schedule, group_name: str,
                       capturing: bool = False, sc: Scaled | None = None) -> str | None:
    """Why this call cannot run the GPU schedule (None: it can).  K parts (ops.k_parts) run
    on every schedule: they are no reason."""
    if schedule.name in ("oneshot", "twoshot"):
        from torch_commopt.kernels.matmul.gpu.lowlat_ar import refusal

        return refusal(a, weight, world, group_name, capturing, sc)
    rows = a.numel() // max(1, a.shape[-1])
    if weight.dim() != 2:
        return "batched (3-D) weight"
    if scatter_dim is not None and scatter_dim == a.dim() - 1:
        return "scatter along the output's last dim"
    if rows == 0 or rows % world:
        return f"{rows} rows do not split evenly over {world} ranks"
    if sc is not None and schedule.name in ("fused", "ce_pull"):
        return f"{schedule.name} has no scaled (float8) product: cuBLAS's _scaled_mm cannot add into its output"
    if schedule.name == "fused" and a.dtype not in (torch.bfloat16, torch.float16):
        return f"fused needs bf16/fp16, got {a.dtype}"
    if weight.dtype != a.dtype and sc is None:
        return "mixed dtypes"
    if capturing:
        op, phases = ("matmul_ar", 2) if scatter_dim is None else ("matmul_rs", 1)
        return symm.capture_refusal(group_name, a.device, op, schedule,
                                    buffer_bytes(a, weight, world, phases=phases, sc=sc))
    return None


def buffer_bytes(a, weight, world: int, *, phases: int, sc: Scaled | None = None) -> int:
    """Symmetric buffer bytes a call needs (both halves): partials of the product's dtype."""
    rows = a.numel() // max(1, a.shape[-1])
    return 2 * phases * rows * weight.shape[-1] * out_dtype(a, sc).itemsize


@functools.lru_cache(maxsize=512)
def _plan(shape: tuple, scatter_dim: int | None, world: int, chunks: int) -> tuple:
    """What a call's shape decides, computed once per shape: (layout, pieces)."""
    if scatter_dim is None:  # all-reduce: any row split works; use contiguous row blocks
        lay = RowLayout(1, math.prod(shape[:-1]) // world, world)
    else:
        lay = RowLayout.of(list(shape), scatter_dim, world, gathered=False)
    return lay, tuple(lay.pieces(min(chunks, MAX_CHUNKS)))


class _Call:
    """State of one reduce call: runtime, layout, buffers, half, streams."""

    def __init__(self, prod: Product, scatter_dim, group_name, sched: Schedule, reduce_op, *, phases: int):
        a, weight, sc, parts = prod.a, prod.weight, prod.sc, prod.parts
        self.rt = rt = symm.runtime(group_name, a.device)
        self.sched, self.world, self.rank = sched, rt.world, rt.rank
        self.debug = rt.debug_waits(sched)
        self.k, self.n = a.shape[-1], weight.shape[-1]
        self.lay, self.pieces = _plan(tuple(a.shape), scatter_dim, rt.world, sched.chunks)
        self.m_seg = self.lay.local_rows
        self.a2 = a.contiguous().view(-1, self.k)
        # every K part as a (rows, K_i) matrix and its weight; (a2, weight) first
        self.a2s = [self.a2] + [x.contiguous().view(-1, x.shape[-1]) for x, _ in parts]
        self.ws = [weight] + [w for _, w in parts]
        self.sc, self.dtype = sc, out_dtype(a, sc)  # the partials' dtype: the product's
        self.seg_bytes = self.m_seg * self.n * self.dtype.itemsize
        self.phases, self.n_chunks = phases, len(self.pieces)
        self.buf = rt.buffer(buffer_bytes(a, weight, rt.world, phases=phases, sc=sc))
        self.alpha = 1.0 / rt.world if reduce_op == "avg" else 1.0
        self.epoch = rt.next_epoch()  # the fused kernel's barrier counts epochs
        self.half = self.epoch % 2  # calls alternate buffer halves
        # Half h starts at the same offset whatever the op or shape: the FREE tokens guard
        # halves, so two calls' half-0 and half-1 regions must never overlap in one buffer.
        self.base = self.half * (self.buf.nbytes // 2)
        self.recv = self.buf.view(self.rank, self.base, (rt.world, self.m_seg, self.n), self.dtype)
        self.cur, self.side = torch.cuda.current_stream(a.device), rt.side
        self.side_used = False  # join the side stream only if this call forked it (graph capture)
        self.wide = Expanded(self.ws)  # the K parts' weights for row blocks (weights_for)

    def slot(self, owner: int, sender: int, region: int = 0, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Slot `sender` of rank `owner`'s buffer (region 0: partials, 1: all-gather), or its
        rows [lo, hi): the buffer's cached views, where slicing the slot costs a view a call."""
        hi = self.m_seg if hi is None else hi
        offset = self.base + (region * self.world + sender) * self.seg_bytes + lo * self.n * self.dtype.itemsize
        return self.buf.view(owner, offset, (hi - lo, self.n), self.dtype)

    def peer_slot(self, p: int, region: int = 0) -> torch.Tensor:
        """This rank's receive slot in rank p's buffer."""
        return self.slot(p, self.rank, region)

    def after_caller(self) -> None:
        """Make the side stream wait for the caller's stream as it stands now."""
        self.rt.after(self.side, self.cur)
        self.side_used = True

    def acquire(self, stream, p: int, *, defer_take: bool = False) -> None:
        """Wait for p's token (symm.GroupRuntime.acquire; defer_take: the next `signal` to p takes it)."""
        self.rt.acquire(stream, p, self.half, debug=self.debug, defer_take=defer_take)

    def signal(self, stream, p: int, c: int, phase: int = 0) -> None:
        """Chunk c of this rank's data for p (phase 0: partial, 1: reduced) has landed."""
        self.rt.signal(stream, p, data_index(self.half, self.rank, c, phase), 1)

    def finish(self, out, bias, reduce_op: str, op: str):
        """Join the side stream, lower the flags and give the tokens back (this rank's reads
        are done), add the bias (every rank added it before the reduction: W times for sum,
        once for avg)."""
        if self.side_used:
            self.rt.after(self.cur, self.side)
        self.rt.done_reading(self.cur, self.half, self.n_chunks, phases=self.phases)
        if bias is not None:
            out.add_(bias, alpha=1.0 if reduce_op == "avg" else float(self.world))
        if self.debug:
            self.rt.check_status(op)
        return out

    def segment_a(self, p: int) -> list[torch.Tensor]:
        """The A rows producing segment p, one per K part: an (m_seg, K_i) matrix (outer == 1:
        contiguous rows), else the strided (outer, lin, K_i) view of its rows in every outer
        block, which the products take as one batched GEMM without a copy (a (B, S, K) input
        scattered along S; float8 alone copies them into a matrix: _scaled_mm is 2-D only)."""
        out = []
        for a2 in self.a2s:
            rows = self.lay.block_rows(a2, p, 0, self.m_seg)
            out.append(rows if self.lay.outer == 1 or self.sc is None else rows.reshape(self.m_seg, a2.shape[-1]))
        return out

    def piece(self, seg: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
        """Rows [lo, hi) of a segment's A rows (segment_a): whole outer blocks of a strided view."""
        return [blocks_of(x, lo, hi, self.lay.lin) if x.dim() == 3 else piece_rows(x, lo, hi) for x in seg]

    def weights_for(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """The K parts' weights for these rows: as they are for matrices, expanded to the row
        blocks' batch (stride 0) for (blocks, lin, K) views -- once per call and batch size."""
        return self.ws if rows[0].dim() == 2 else self.wide(rows[0].shape[0])

    def product(self, rows: list[torch.Tensor], out: torch.Tensor) -> None:
        """out <- the rows' product: rows[0] @ w_0 (scaled: _scaled_mm), then each further K
        part's product added in place."""
        out, ws = as_blocks(out, rows[0]), self.weights_for(rows)
        matmul(rows[0], ws[0], None, self.sc, out=out)
        for x, w in zip(rows[1:], ws[1:]):
            add_matmul_(out, x, w)

    def add_product(self, out: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """out <- alpha * (out + the rows' product), in place (addmm_: no copy of C)."""
        out, ws = as_blocks(out, rows[0]), self.weights_for(rows)
        add_matmul_(out, rows[0], ws[0], beta=self.alpha, alpha=self.alpha)
        for x, w in zip(rows[1:], ws[1:]):
            add_matmul_(out, x, w, alpha=self.alpha)

    def wait(self, stream, src, c, what, phase: int = 0):
        self.rt.wait(stream, data_index(self.half, src, c, phase), 1, debug=self.debug, what=what, src=src, chunk=c)


def _for_fused(prod: Product, sched: Schedule) -> Product:
    """`fused` multiplies one operand pair: the K parts concatenated along K (a copy each call)."""
    if not prod.parts or sched.name != "fused":
        return prod
    parts = prod.parts
    return prod._replace(a=torch.cat([prod.a, *(x for x, _ in parts)], dim=-1),
                         weight=torch.cat([prod.weight, *(w for _, w in parts)], dim=0), parts=())


def matmul_rs_gpu(prod: Product, scatter_dim, reduce_op, group_name, sched: Schedule):
    prod = _for_fused(prod, sched)
    a, weight, bias, sc = prod.a, prod.weight, prod.bias, prod.sc
    rt = symm.runtime(group_name, a.device)
    sched = pull_placed(sched, rt.world, "matmul_rs")
    out_shape = list(a.shape[:-1]) + [weight.shape[-1]]
    out_shape[scatter_dim] //= rt.world
    out = a.new_empty(out_shape, dtype=out_dtype(a, sc))  # outside a per-call graph: the caller owns it

    def body():
        call = _Call(prod, scatter_dim, group_name, sched, reduce_op, phases=1)
        _reduce_scatter_into(call, weight, out.view(call.m_seg, call.n))
        call.finish(out, bias, reduce_op, "matmul_rs")

    scales, flags = call_key(sc)
    call_graphs.call("matmul_rs", sched, rt, (a, weight, bias, out, *scales, *prod.part_tensors()),
                     (scatter_dim, reduce_op, *flags),
                     body, lambda: unsupported_reason(a, weight, scatter_dim, rt.world, sched, group_name, True, sc))
    return out


def matmul_ar_gpu(prod: Product, reduce_op, group_name, sched: Schedule):
    if sched.name in ("oneshot", "twoshot"):
        from torch_commopt.kernels.matmul.gpu.lowlat_ar import matmul_ar_lowlat

        return matmul_ar_lowlat(prod, reduce_op, group_name, sched)
    prod = _for_fused(prod, sched)
    a, weight, bias, sc = prod.a, prod.weight, prod.bias, prod.sc
    rt = symm.runtime(group_name, a.device)
    sched = pull_placed(sched, rt.world, "matmul_ar")
    out = a.new_empty(list(a.shape[:-1]) + [weight.shape[-1]], dtype=out_dtype(a, sc))  # outside a per-call graph

    def body():
        call = _Call(prod, None, group_name, sched, reduce_op, phases=2)
        full = out.view(-1, call.n)
        own = full[call.rank * call.m_seg: (call.rank + 1) * call.m_seg]
        # The peers' reduced pieces are copied into `out` on the local copy stream, ordered
        # after the caller's work before anything of this call is queued: each copy then
        # waits only for its piece's flag, not behind this rank's own pushes on the side
        # stream (there, every copy waited for the last push).  `fused` keeps them on the side
        # stream: in debug mode each wait is a one-block kernel, and the persistent GEMM's
        # grid leaves a single SM for them.
        gather = call.side if call.sched.name == "fused" else call.rt.local
        if gather is not call.side:
            call.rt.after(gather, call.cur)
        _reduce_scatter_into(call, weight, own, after_piece=lambda c, lo, hi: _push_reduced(call, own, c, lo, hi))
        for c, (lo, hi) in enumerate(call.pieces):
            for src in call.rt.sources:
                call.wait(gather, src, c, "reduced chunk", phase=1)
                got = call.slot(call.rank, src, region=1)
                call.rt.copy(gather, full[src * call.m_seg + lo: src * call.m_seg + hi], piece_rows(got, lo, hi))
        if gather is not call.side:
            call.rt.after(call.cur, gather)
        call.finish(out, bias, reduce_op, "matmul_ar")

    scales, flags = call_key(sc)
    call_graphs.call("matmul_ar", sched, rt, (a, weight, bias, out, *scales, *prod.part_tensors()),
                     (reduce_op, *flags), body,
                     lambda: unsupported_reason(a, weight, None, rt.world, sched, group_name, True, sc))
    return out


def _push_reduced(call: _Call, own, c, lo, hi):
    """All-gather phase of matmul_ar: piece c of the reduced own segment to every peer."""
    call.after_caller()
    piece = piece_rows(own, lo, hi)
    for p in call.rt.peers:
        call.rt.copy(call.side, piece_rows(call.peer_slot(p, region=1), lo, hi), piece)
        call.signal(call.side, p, c, phase=1)


def _reduce_scatter_into(call: _Call, weight, own, after_piece=None):
    """own (m_seg, N) <- reduced segment `rank` of A @ weight (bias added by the caller)."""
    if call.sched.name == "fused":
        _fused(call, weight, own)
        if after_piece is not None:
            for c, (lo, hi) in enumerate(call.pieces):
                after_piece(c, lo, hi)
        return
    if call.sched.name == "ce_pull":
        _pull_reduce(call, own, after_piece)
        return
    rt = call.rt
    in_place = _adds_in_place(call)
    if in_place:
        # The local copy stream writes `own` (allocated on the caller's stream): order it
        # after the caller's work so far, before the peers' GEMMs are queued, so a partial
        # that has landed is moved in while those GEMMs still run.  (Ordered after them, the
        # first own GEMM waits for its copy: ~40 us idle per call at rs 8192^3 ce_push:2.)
        rt.after(rt.local, call.cur)
    staging = None if call.sched.name == "direct" else _staging(call, own)
    # Every peer's token before this call's first write on the caller's stream: direct writes
    # into the peers' buffers, and ce_push stages in this rank's own buffer half (W = 2) and
    # puts the own product there (W > 2), bytes that a peer may still be pulling from, at a
    # ce_pull call of another shape in this half, until it gives the token back.
    for p in rt.peers:
        call.acquire(call.cur, p, defer_take=True)
    for p in rt.peers:
        a_p, slot = call.segment_a(p), call.peer_slot(p)
        if staging is not None:
            staged = staging[p]
        for c, (lo, hi) in enumerate(call.pieces):
            rows = call.piece(a_p, lo, hi)
            if staging is None:
                call.product(rows, piece_rows(slot, lo, hi))
                call.signal(call.cur, p, c)
            else:
                piece = piece_rows(staged, lo, hi)
                call.product(rows, piece)
                _ship(call, piece, piece_rows(slot, lo, hi), p, c)
    a_r = call.segment_a(call.rank)
    if in_place:
        _own_in_place(call, a_r, own, rt.sources[0], after_piece)
        return
    if len(rt.sources) == 1 and call.sc is None:
        _own_then_add(call, a_r, own, rt.sources[0], after_piece)
        return
    mine = call.slot(call.rank, call.rank)  # this rank's own receive slot (a cached view)
    for c, (lo, hi) in enumerate(call.pieces):
        # The own product goes to this rank's own slot (no peer writes it) before the waits,
        # so it runs while the last partials are still landing.
        call.product(call.piece(a_r, lo, hi), piece_rows(mine, lo, hi))
        for src in rt.sources:
            call.wait(call.cur, src, c, "partial")
        _sum_slots(call, call.recv if call.n_chunks == 1 else call.recv[:, lo:hi], piece_rows(own, lo, hi))
        if after_piece is not None:
            after_piece(c, lo, hi)


def _staging(call: _Call, own):
    """ce_push's staging of each peer's product (staging[p]: (m_seg, N)).  At two ranks, this rank's
    own receive slot of the buffer half: no peer writes it (the one peer's partial lands in the
    peer's slot), no peer reads it once the caller's stream has the peer's token (a ce_pull of
    another shape may have left the peer bytes to pull there), and the call's closing join orders
    its next writer after this call's copies out of it -- a buffer's address, where a per-call
    allocation would be elsewhere at every call
    (kernels/gpu/host_replay.py replays the recorded address).  At W > 2 the own slot takes the own
    product: a fresh (W, m_seg, N) tensor."""
    if call.world == 2:
        return {call.rt.peers[0]: call.slot(call.rank, call.rank)}
    return torch.empty((call.world, call.m_seg, call.n), dtype=call.dtype, device=own.device)


def _own_in_place(call: _Call, a_r, own, src: int, after_piece):
    """One source (W = 2): the local copy stream moves each received partial into the
    output as soon as it lands (the copy engine, beside the GEMMs still running), and the
    own piece's GEMM adds into it in place (addmm_): the reduction costs the SMs nothing
    but the epilogue's read of C, where addmm(C, out=D) would first copy C into D on them.
    The local stream was ordered after the caller's stream before the peers' GEMMs
    (_reduce_scatter_into)."""
    rt, local = call.rt, call.rt.local
    landed, got = rt.events(call.n_chunks), call.slot(call.rank, src)
    for c, (lo, hi) in enumerate(call.pieces):
        call.wait(local, src, c, "partial")
        rt.copy(local, piece_rows(own, lo, hi), piece_rows(got, lo, hi))
        driver.record(landed[c], local)
    for c, (lo, hi) in enumerate(call.pieces):
        driver.wait_event(call.cur, landed[c])
        call.add_product(piece_rows(own, lo, hi), call.piece(a_r, lo, hi))
        if after_piece is not None:
            after_piece(c, lo, hi)


def _adds_in_place(call: _Call) -> bool:
    """W = 2 (one source) cuBLAS reductions add the received partial in place (_own_in_place),
    but ce_push:1 (_own_then_add) and float8 (_scaled_mm cannot add into its output)."""
    return (len(call.rt.sources) == 1 and call.sc is None
            and not (call.n_chunks == 1 and call.sched.name == "ce_push"))


def _own_then_add(call: _Call, a_r, own, src: int, after_piece):
    """ce_push:1 at W = 2: the own GEMM starts at once, while the copy engine is still
    moving the peer's partial here, and the partial is added after it (the sum NCCL's
    reduce-scatter makes of two rounded partials).  In place, the own GEMM would wait for
    the whole partial: peer GEMM -> copy -> own GEMM in series (1.02 vs 0.86 ms for
    ce_push:2 at 8192^3)."""
    call.product(a_r, own)
    call.wait(call.cur, src, 0, "partial")
    own.add_(call.slot(call.rank, src))
    if call.alpha != 1.0:
        own.mul_(call.alpha)
    if after_piece is not None:
        after_piece(0, *call.pieces[0])


def _pull_reduce(call: _Call, own, after_piece):
    """ce_pull.  A rank's buffer half is rewritten only after every peer has finished the
    call that last pulled from it (the peer's token), which also covers the matmul_ar
    pushes into the peers' buffers that follow."""
    rt, sources = call.rt, call.rt.sources
    # One source (W = 2): pull into the output itself.  More: into a local stack, slot s for
    # source s and the own product in slot `rank`, summed in one pass (_sum_slots).
    pulled = None if len(sources) == 1 else torch.empty(
        (call.world, call.m_seg, call.n), dtype=call.dtype, device=own.device)
    # The pulls run on the local copy stream, which writes `own` / `pulled` (allocated on the
    # caller's stream): ordered after the caller's work so far, before the peers' GEMMs are
    # queued, so the first pulls run beside those GEMMs.  Not on the side stream: there a
    # matmul_ar's pull of piece c + 1 queued behind its push of reduced piece c, which waits
    # for piece c's GEMM, so each own GEMM waited for a push and a pull in series.
    local = rt.local
    rt.after(local, call.cur)
    for p in rt.peers:
        call.acquire(call.cur, p, defer_take=True)
    for p in rt.peers:
        a_p = call.segment_a(p)
        for c, (lo, hi) in enumerate(call.pieces):
            call.product(call.piece(a_p, lo, hi), call.slot(call.rank, p, 0, lo, hi))
            call.signal(call.cur, p, c)
    a_r = call.segment_a(call.rank)
    for c, (lo, hi) in enumerate(call.pieces):
        own_piece = piece_rows(own, lo, hi)
        for src in sources:
            call.wait(local, src, c, "partial")
            dst = own_piece if pulled is None else pulled[src, lo:hi]
            rt.copy(local, dst, call.slot(src, call.rank, 0, lo, hi))
        if pulled is None:
            rt.after(call.cur, local)
            call.add_product(own_piece, call.piece(a_r, lo, hi))
        else:
            call.product(call.piece(a_r, lo, hi), pulled[call.rank, lo:hi])  # beside the pulls
            rt.after(call.cur, local)
            _sum_slots(call, pulled[:, lo:hi], own_piece)
        if after_piece is not None:
            after_piece(c, lo, hi)


def _ship(call: _Call, src_piece, dst_piece, p, c):
    """Copy engine: staging piece -> peer p's receive slot, then flag it (the first signal
    takes the token the caller's stream waited for: _reduce_scatter_into)."""
    call.after_caller()
    call.rt.copy(call.side, dst_piece, src_piece)
    call.signal(call.side, p, c)


def _sum_slots(call: _Call, stack, dst):
    """dst = alpha * stack.sum(0) for stack (W, rows, N), the W rounded partials of one piece
    (the own product among them): one pass over them, accumulated in fp32 (sum: alpha = 1;
    avg: alpha = 1/W, the mean).  Not an fp32 copy of the own product plus one
    read-modify-write per source: that moves about 5x the bytes, and at 4 ranks puts rs 8192^3
    ce_push:1 ~25% behind NCCL."""
    (torch.sum if call.alpha == 1.0 else torch.mean)(stack, dim=0, out=dst)


def _fused(call: _Call, weight, own):
    rt, p = call.rt, {**FUSED_DEFAULTS, **dict(call.sched.params)}
    if p["store"] not in ("direct", "ce"):
        raise ValueError(f"commopt matmul_rs fused: store must be 'direct' or 'ce', got {p['store']!r}")
    direct = p["store"] == "direct"
    if p.get("impl") == "sm90":  # its tile, also for the Triton kernel should it refuse the operands
        p.update(bm=sm90.BM, bn=sm90.RS_BN)
    tiles_m, tiles_n = cdiv(call.m_seg, p["bm"]), cdiv(call.n, p["bn"])
    chunk_mt = max(1, (call.pieces[0][1] - call.pieces[0][0]) // p["bm"])  # M tiles per piece
    n_chunks = cdiv(tiles_m, chunk_mt)
    if n_chunks > MAX_CHUNKS:
        chunk_mt, n_chunks = cdiv(tiles_m, MAX_CHUNKS), MAX_CHUNKS
    call.n_chunks = n_chunks
    for q in rt.peers:  # the kernel (direct) or the side stream (ce) writes into every peer
        call.acquire(call.cur, q)
    rt.reset_counters(call.cur, n_chunks)
    rt.barrier(call.cur, call.epoch, debug=call.debug)
    send = own if direct else torch.empty((call.world, call.m_seg, call.n), dtype=call.dtype, device=own.device)
    if not direct:
        call.after_caller()  # the side stream's copies below follow the barrier, not the kernel
    host_bases = call.buf.host_bases()
    targets = RsTargets(own, send, call.recv, call.buf.ptrs_dev, call.base // call.recv.element_size(), direct,
                        all(ptr % 16 == 0 for ptr in host_bases), host_bases)
    signals = RsSignals(rt.flags, rt.flag_bases_dev, rt.status, data_index(call.half, 0, 0))
    segments = RsSegments(rt.rank, rt.world, call.lay.lin, call.m_seg, chunk_mt)
    for src in rt.sources:  # the kernel's spins, for the watchdog
        for c in range(n_chunks):
            if direct:
                tiles = min(chunk_mt, tiles_m - c * chunk_mt) * tiles_n
                rt.expect(COUNTERS + src * MAX_CHUNKS + c, tiles, src=src, what="tiles", chunk=c)
            else:
                rt.expect(data_index(call.half, src, c), 1, src=src, what="partial", chunk=c)
    launch_rs_fused(call.a2, weight, targets, signals, segments, call.alpha, p, debug=call.debug)
    if not direct:
        # The copy engine ships each piece as soon as its tiles are counted.  Enqueued after
        # the kernel's launch (the first launch JIT-compiles for seconds, which a bounded
        # debug wait enqueued earlier would count against its bound).
        for q in rt.peers:
            for c in range(n_chunks):
                lo, hi = c * chunk_mt * p["bm"], min(call.m_seg, (c + 1) * chunk_mt * p["bm"])
                tiles = min(chunk_mt, tiles_m - c * chunk_mt) * tiles_n
                rt.wait(call.side, COUNTERS + q * MAX_CHUNKS + c, tiles, debug=call.debug, what="tiles", src=q, chunk=c)
                rt.copy(call.side, call.peer_slot(q)[lo:hi], send[q, lo:hi])
                call.signal(call.side, q, c)


def launch_rs_fused(a2, weight, targets: RsTargets, signals: RsSignals, segments: RsSegments, alpha, params,
                    debug=False):
    """The fused reduce-scatter GEMM (rs_gemm_kernel): a2 (world * m_seg, K) rows in the
    layout's order (segments); targets.out <- alpha * this rank's reduced segment; where the
    peers' segments go and the partials come from: targets; the flags: signals.  params: the
    schedule's (bm, bn, bk, gm, warps, stages, sms, tma).  tma=1 moves the tiles with the TMA
    unit (the kernel's TMA=True) where the operands allow it (aligned, every tile one run of rows: one outer
    block or lin a multiple of bm), else pointer loads.  Callable on one GPU with local
    stand-ins for the peers' buffers and flags set beforehand
    (tests/gpu/test_fused_gemm_one_gpu.py)."""
    from torch_commopt.kernels.matmul.gpu.triton_kernels import num_sms, rs_gemm_kernel

    p = {**FUSED_DEFAULTS, **params}
    if p.get("flat"):
        raise ValueError("commopt matmul_rs fused: flat=1 is an option of the all-gather consumer; the "
                         "reduce-scatter kernel keeps its tile and k loops nested")
    if p.get("impl") == "sm90" and sm90.rs_gemm(a2, weight, targets, signals, segments, alpha,
                                               sm90.Launch.of(params, a2.device, debug, segments.world)):
        return
    driver.untapped("launches a Triton kernel")
    k, n = a2.shape[-1], weight.shape[-1]
    out, send, recv, recv_bases, recv_off, direct, bases_aligned, _host = targets
    flags, flag_bases, status, data_base, epoch = signals
    rank, world, lin, m_seg, chunk_mt = segments
    # Debug waits are one-block kernels on the side stream: leave them an SM, or a grid
    # spinning on every SM would starve the very wait its data depends on.
    sms = (p.get("sms") or num_sms(out.device)) - (1 if debug else 0)
    grid = max(1, min(sms, world * cdiv(m_seg, p["bm"]) * cdiv(n, p["bn"])))
    one_run = lin == m_seg or lin % p["bm"] == 0  # every tile's rows one contiguous run of A
    split = None if one_run else f"a tile's rows span two runs of A (run of {lin} rows, bm {p['bm']})"
    descs = tma.descriptors("matmul_rs", [a2], [weight], p["bm"], p["bn"], p["bk"], split) if p.get("tma") else None
    a_op, b_op, kmajor = (a2, weight, False) if descs is None else (descs[0][0], descs[1][0], descs[2])
    elt = out.element_size()
    dst_aligned = bases_aligned and (recv_off * elt) % 16 == 0 and (m_seg * n * elt) % 16 == 0
    rs_gemm_kernel[(grid,)](
        a_op, b_op, out, out, send, recv, recv_bases, flags, flag_bases, status, epoch, symm.wait_bound(), recv_off,
        data_base, weight.stride(0), weight.stride(1), n, k, m_seg, lin, rank, chunk_mt, alpha, 0.0, grid,
        WORLD=world, DIRECT=direct, HAS_BIAS=False, BM=p["bm"], BN=p["bn"], BK=p["bk"], GROUP_M=p["gm"],
        EVEN_K=k % p["bk"] == 0, DEBUG=debug, COUNTERS=COUNTERS, DST_ALIGNED=dst_aligned, TMA=descs is not None,
        B_KMAJOR=kmajor, num_warps=p["warps"], num_stages=p["stages"])
