"""GPU schedules of all-gather + matmul (`ce_push`, `fused`).

Protocol (one call in buffer half h, rank r of W; calls alternate the halves; see symm):
  side stream:  wait for the caller's stream -> for each peer p (r+1, r+2, ...): take the
                (h, p) token (p has finished reading what r sent it in half h before),
                then copy-engine copy of piece c of the shard into p's slot r, then set
                p.DATA[h, r, c] = 1.
  caller stream: multiply the local shard straight from the input (no wait, no staging
                copy), then the peers' slots in arrival order (r-1, r-2, ...), each piece
                after its flag: cuBLAS per piece (ce_push) or one persistent Triton GEMM
                spinning on the flags (fused).
The caller's stream joins the side stream at the end, so the input (read by the copy
engine) and the outputs stay valid for the caching allocator, then lowers its DATA flags
and gives every source its token back.  Every value is a constant: the call can be
captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, NamedTuple

import torch

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import call_graphs, driver, symm
from torch_commopt.kernels.gpu.symm import MAX_CHUNKS, data_index
from torch_commopt.kernels.matmul.gpu import sm90, tma
from torch_commopt.kernels.matmul.gpu.layout import RowLayout, cdiv, piece_rows
from torch_commopt.kernels.scaled import Expanded, Scaled, call_key, matmul, out_dtype

FUSED_DEFAULTS = {"bm": 128, "bn": 256, "bk": 64, "gm": 8, "warps": 8, "stages": 3, "flat": 1}


# The values below are built on every call: NamedTuples, which cost a fraction of a frozen
# dataclass's construction on the host path.
class Products(NamedTuple):
    """What an all-gather + matmul call multiplies and where it writes: outs[i] = gathered A @
    weights[i] (+ biases[i]); sc: the products are scaled (float8, kernels/scaled.py; None: plain)."""

    weights: list
    biases: list
    outs: list
    sc: Scaled | None = None


class Arrivals(NamedTuple):
    """Where and when a fused consumer finds the gathered rows: this rank is `rank` of `world`,
    each rank's rows come in runs of `lin` (RowLayout.lin) and in pieces of `chunk_rows` rows;
    piece c of slot s has landed once flags[flag_base + s * 256 + c] >= epoch; status: where a
    debug wait reports."""

    flags: torch.Tensor
    status: torch.Tensor
    flag_base: int
    rank: int
    world: int
    lin: int
    chunk_rows: int
    epoch: int = 1


class _Gather(NamedTuple):
    """One call as its consumers read it: the group's runtime, the local shard as an (M_loc, K)
    matrix, the products, the layout and pieces, the buffer half, whether waits are debug waits."""

    rt: Any
    a2: torch.Tensor
    mm: Products
    lay: RowLayout
    pieces: tuple
    half: int
    debug: bool


def unsupported_reason(a, weights, gather_dim: int, schedule: Schedule, group_name: str, world: int,
                       capturing: bool = False, sc: Scaled | None = None) -> str | None:
    """Why this call cannot run the GPU schedule (None: it can)."""
    if gather_dim == a.dim() - 1:
        return "gather along the contracted dim"
    if any(w.dim() != 2 for w in weights):
        return "batched (3-D) weights"
    if a.numel() == 0:
        return "empty input"
    if sc is not None and schedule.name == "fused":
        return "fused has no scaled (float8) product; ce_push runs cuBLAS's _scaled_mm per piece"
    if schedule.name == "fused" and a.dtype not in (torch.bfloat16, torch.float16):
        return f"fused needs bf16/fp16, got {a.dtype}"
    if sc is None and any(w.dtype != a.dtype for w in weights):
        return "mixed dtypes"
    if capturing:
        return symm.capture_refusal(group_name, a.device, "ag_matmul", schedule, buffer_bytes(a, world))
    return None


def buffer_bytes(a, world: int) -> int:
    """Symmetric buffer bytes a call needs (both halves)."""
    return 2 * world * a.numel() * a.element_size()


@functools.lru_cache(maxsize=512)
def _plan(shape: tuple, gather_dim: int, world: int, chunks: int) -> tuple:
    """What a call's shape decides, computed once per shape: (layout, pieces, gathered shape)."""
    lay = RowLayout.of(list(shape), gather_dim, world, gathered=True)
    gshape = list(shape[:gather_dim]) + [world * shape[gather_dim]] + list(shape[gather_dim + 1:])
    return lay, tuple(lay.pieces(min(chunks, MAX_CHUNKS))), gshape


def ag_matmul_gpu(a, weights, biases, gather_dim, group_name, sched: Schedule, return_gathered,
                  sc: Scaled | None = None):
    rt = symm.runtime(group_name, a.device)
    lay, pieces, gshape = _plan(tuple(a.shape), gather_dim, rt.world, sched.chunks)
    # The outputs are allocated here, outside a per-call graph (the caller owns them), and before
    # the side stream syncs with the caller's stream: the side stream writes `gathered`, and its
    # block's previous owner may still have caller-stream work pending (the caching allocator
    # orders reuse on the allocating stream only).
    outs = [a.new_empty(gshape[:-1] + [w.shape[-1]], dtype=out_dtype(a, sc)) for w in weights]
    gathered = a.new_empty(gshape) if return_gathered else None
    mm = Products(weights, biases, outs, sc)

    def body():
        _gather_and_multiply(rt, a, sched, mm, lay, pieces, gathered)

    scales, flags = call_key(sc)
    call_graphs.call("ag_matmul", sched, rt, (a, *weights, *biases, *outs, gathered, *scales), (gather_dim, *flags),
                     body, lambda: unsupported_reason(a, weights, gather_dim, sched, group_name, rt.world, True, sc))
    return outs + ([gathered] if return_gathered else [])


def _gather_and_multiply(rt, a, sched: Schedule, mm: Products, lay, pieces, gathered) -> None:
    debug = rt.debug_waits(sched)
    world, rank = rt.world, rt.rank
    m_loc, k = lay.local_rows, a.shape[-1]
    a2 = a.contiguous().view(m_loc, k)
    row_bytes = k * a.element_size()
    buf = rt.buffer(buffer_bytes(a, world))
    half = rt.next_epoch() % 2  # calls alternate buffer halves
    base = half * (buf.nbytes // 2)  # the same offset for every op: tokens guard halves
    slots = buf.view(rank, base, (world, m_loc, k), a.dtype)
    cur, side = torch.cuda.current_stream(a.device), rt.side
    call = _Gather(rt, a2, mm, lay, pieces, half, debug)

    # Each peer's token is taken with the first piece's signal to it and awaited before the
    # pushes into its buffer: on the side stream, or for gemm=whole on the caller's stream, which
    # the side stream then follows, since gemm=whole also copies into this rank's own slot, bytes a
    # peer may still be pulling (left by a reduce-scatter of another shape in this half).
    whole = sched.param("gemm") == "whole"
    if whole:
        for p in rt.peers:
            rt.acquire(cur, p, half, debug=debug, defer_take=True)
    rt.after(side, cur)
    src_ptr = a2.data_ptr()
    for p in rt.peers:  # driver calls on the side stream: no stream context, no tensor views
        if not whole:
            rt.acquire(side, p, half, debug=debug, defer_take=True)
        dst_ptr = buf.address(p, base + rank * m_loc * row_bytes)
        for c, (lo, hi) in enumerate(pieces):
            driver.memcpy_async(side, dst_ptr + lo * row_bytes, src_ptr + lo * row_bytes, (hi - lo) * row_bytes)
            rt.signal(side, p, data_index(half, rank, c), 1)

    if whole or sched.name == "fused":
        if sched.name == "fused":
            _consume_fused(call, slots, sched)
        else:
            _consume_whole(call, slots, cur)
        if gathered is not None:
            _gathered(call, slots, gathered, side)
    else:
        slot_of = functools.partial(_source_slot, buf, rank, base, m_loc, k, row_bytes, a.dtype)
        early = gathered is not None and env.gather_own_early()
        landed = None if gathered is None else functools.partial(_gather_landed, call, slots, gathered, side,
                                                                 own=not early)
        own = functools.partial(_gather_own_early, call, slots, gathered) if early else None
        _consume_cublas(call, slot_of, cur, rt.compute2 if sched.param("par") else None, landed, own)
        if early:
            rt.after(cur, rt.local)
    rt.after(cur, side)
    rt.done_reading(cur, half, len(pieces))
    if debug:
        rt.check_status("ag_matmul")


def _source_slot(buf, rank: int, base: int, m_loc: int, k: int, row_bytes: int, dtype, src: int) -> torch.Tensor:
    """Source src's (M_loc, K) slot of this rank's buffer half at `base` (rows of row_bytes):
    slots[src] of ag_matmul_gpu's (W, M_loc, K) view, as the buffer's cached view (indexing
    `slots` costs a new view every call)."""
    return buf.view(rank, base + src * m_loc * row_bytes, (m_loc, k), dtype)


def _consume_cublas(call: _Gather, slot_of, cur, second=None, landed=None, own=None):
    """cuBLAS per piece; slot_of(src): source src's (M_loc, K) slot.  second (par=1): the peers'
    pieces run on that stream, so their GEMMs can share the SMs with the own shard's (the GEMMs
    write disjoint rows).  call.mm.sc: each piece is a scaled (float8) product.  landed(stream,
    src, first): called once each source's last piece has landed, right before that piece's
    GEMMs are queued on `stream` (`_gather_landed`).  own(stream): the own rows' copy into the
    gathered input, called around the own shard's GEMM (`_gather_own_early`)."""
    rt, mm, lay = call.rt, call.mm, call.lay
    rank = rt.rank
    full = [o.view(-1, o.shape[-1]) for o in mm.outs]
    wide = Expanded(mm.weights)
    peers = cur if second is None else second
    if second is not None:
        rt.after(second, cur)  # the outputs were allocated on the caller's stream
    copy_own = own(cur) if own is not None else None
    # Own shard first, as one GEMM: it needs nothing from the peers.
    _piece_matmuls(call.a2, full, wide, mm, lay, rank, 0, lay.local_rows)
    if copy_own is not None:
        copy_own()
    last = len(call.pieces) - 1
    with contextlib.nullcontext() if second is None else torch.cuda.stream(second):
        for i, src in enumerate(rt.sources):
            slot = slot_of(src)
            for c, (lo, hi) in enumerate(call.pieces):
                rt.wait(peers, data_index(call.half, src, c), 1, debug=call.debug, what="chunk", src=src, chunk=c)
                if c == last and landed is not None:
                    landed(peers, src, i == 0)
                _piece_matmuls(piece_rows(slot, lo, hi), full, wide, mm, lay, src, lo, hi)
    if second is not None:
        rt.after(cur, second)


def _consume_whole(call: _Gather, slots, cur):
    """ce_push:S:gemm=whole: the own shard joins the peers' in the buffer and one GEMM runs
    over all of them once they are there.  At short M a GEMM's time is reading B, so the
    overlapped form (one GEMM per shard) reads B W times; this one reads it once and hides
    nothing (AG 512x8192x8192 replayed: GEMM alone 0.047 ms, ce_push:1 0.082)."""
    rt, a2, mm, lay = call.rt, call.a2, call.mm, call.lay
    slots[rt.rank].copy_(a2)  # after the tokens, awaited on this stream (_gather_and_multiply)
    last = len(call.pieces) - 1
    for src in rt.sources:  # pieces from one peer land in order: the last flag covers the slot
        rt.wait(cur, data_index(call.half, src, last), 1, debug=call.debug, what="chunk", src=src, chunk=last)
    rows = slots.view(-1, a2.shape[-1])
    for i, (out, w, b) in enumerate(zip(mm.outs, mm.weights, mm.biases)):
        full = out.view(-1, out.shape[-1])
        prod = matmul(rows, w, b, mm.sc, i, out=full if lay.outer == 1 else None)
        if lay.outer != 1:  # slot order is rank-major; the output interleaves outer blocks
            for block in range(rt.world):
                part = prod[block * lay.local_rows:(block + 1) * lay.local_rows]
                dst = lay.block_rows(full, block, 0, lay.local_rows)
                dst.copy_(part.view(dst.shape))


def _piece_matmuls(rows, full, wide: Expanded, mm: Products, lay: RowLayout, block, lo, hi):
    """Rows [lo, hi) of rank-block `block` of each output (full: mm.outs as matrices) <-
    `rows` @ weights[i] (+ biases[i]).  wide: the call's Expanded of the weights (used at
    outer > 1; shared by its pieces)."""
    weights, biases, sc = mm.weights, mm.biases, mm.sc
    if lay.outer != 1 and sc is None:  # rows of several outer blocks: one batched GEMM writes the strided destination
        blocks = (hi - lo) // lay.lin
        rows3 = rows.view(blocks, lay.lin, rows.shape[-1])
        for out, wb, b in zip(full, wide(blocks), biases):
            matmul(rows3, wb, b, out=lay.block_rows(out, block, lo, hi))
        return
    for i, (out, w, b) in enumerate(zip(full, weights, biases)):
        dst = lay.block_rows(out, block, lo, hi)
        if lay.outer == 1:
            matmul(rows, w, b, sc, i, out=dst)
        else:  # _scaled_mm is 2-D only: its product, then a copy into the strided destination
            dst.copy_(matmul(rows, w, b, sc, i).view(dst.shape))


def _consume_fused(call: _Gather, slots, sched):
    rt, a2, mm, pieces = call.rt, call.a2, call.mm, call.pieces
    mm2 = Products(mm.weights, mm.biases, [o.view(-1, o.shape[-1]) for o in mm.outs])  # plain: fused takes no float8
    at = Arrivals(rt.flags, rt.status, data_index(call.half, 0, 0), rt.rank, rt.world, call.lay.lin,
                  pieces[0][1] - pieces[0][0])
    for src in rt.sources:  # the kernel's spins, for the watchdog
        for c in range(len(pieces)):
            rt.expect(data_index(call.half, src, c), 1, src=src, what="chunk", chunk=c)
    launch_fused(a2, slots.view(-1, a2.shape[-1]), mm2, at, dict(sched.params), debug=call.debug)


def launch_fused(a2, slots2, mm: Products, at: Arrivals, params, debug=False):
    """The fused consumer: one persistent Triton GEMM over this rank's shard a2 (M_loc, K) and
    the peers' slots2 (world * M_loc, K) (slot s: rank s's shard, its pieces ready as `at`
    says), writing mm.outs[i] (full rows, N_i) = gathered A @ mm.weights[i] (+ mm.biases[i];
    plain products only).  params: the schedule's (bm, bn, bk, gm, warps, stages, sms,
    tma, impl).  impl=sm90 runs the CUDA kernel (sm90.ag_gemm: its own tile, gm and sms kept)
    where it takes the operands, else (logged once) the Triton one.  tma=1 moves the tiles with
    the TMA unit (ag_gemm_tma_kernel) where the operands allow it (16-byte aligned rows and
    bases), else the pointer-load kernel runs; with tma=1, flat=1 (the default) pipelines each
    phase's tiles as one loop (tma.flat_ok).  Callable on
    one GPU with flags set beforehand (tests/gpu/test_fused_gemm_one_gpu.py)."""
    from torch_commopt.kernels.matmul.gpu.triton_kernels import ag_gemm_kernel, ag_gemm_tma_kernel, num_sms

    p = {**FUSED_DEFAULTS, **params}
    m_loc, k = a2.shape
    if p.get("impl") == "sm90" and sm90.ag_gemm(a2, slots2, mm, at, sm90.Launch.of(params, a2.device, debug, at.world)):
        return
    driver.untapped("launches a Triton kernel")
    world, flags, status, epoch = at.world, at.flags, at.status, at.epoch
    lin, rank, chunk_rows, flag_base = at.lin, at.rank, at.chunk_rows, at.flag_base
    sms = p.get("sms") or num_sms(a2.device)
    for first in range(0, len(mm.weights), 3):  # one pass over A serves up to three B's
        ws, bs = mm.weights[first:first + 3], mm.biases[first:first + 3]
        cs = mm.outs[first:first + 3]
        has_bias = any(b is not None for b in bs)
        bs = [b if b is not None else a2.new_zeros(w.shape[-1]) for w, b in zip(ws, bs)] if has_bias else [a2] * len(ws)
        n_b = len(ws)
        ws3, cs3, bs3 = _pad3(ws), _pad3(cs), _pad3(bs)
        ns = [w.shape[-1] for w in ws] + [0] * (3 - n_b)
        tiles = world * cdiv(m_loc, p["bm"]) * sum(cdiv(n, p["bn"]) for n in ns)
        # Debug waits (the side stream's buffer-free wait) are one-block kernels: leave them an SM.
        grid = max(1, min(sms - (1 if debug else 0), tiles))
        common = dict(WORLD=world, NUM_B=n_b, HAS_BIAS=has_bias, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                      GROUP_M=p["gm"], DEBUG=debug, num_warps=p["warps"], num_stages=p["stages"])
        descs = tma.descriptors("ag_matmul", [a2, slots2], ws3, p["bm"], p["bn"], p["bk"]) if p.get("tma") else None
        if descs is not None:
            (a_d, s_d), b_ds, kmajor = descs
            outs = tma.out_descriptors(cs, lin, p) if p.get("tma_store") else None
            ag_gemm_tma_kernel[(grid,)](
                a_d, s_d, flags, status, epoch, symm.wait_bound(), *b_ds, *(_pad3(outs) if outs else cs3), *bs3, *ns,
                m_loc, k, lin, rank, chunk_rows, flag_base, grid, B_KMAJOR=kmajor, TMA_STORE=outs is not None,
                FLAT=tma.flat_ok(p, k), **common)
            continue
        ag_gemm_kernel[(grid,)](
            a2, slots2, flags, status, epoch, symm.wait_bound(),
            *ws3, *cs3, *bs3,
            ws3[0].stride(0), ws3[0].stride(1), ws3[1].stride(0), ws3[1].stride(1), ws3[2].stride(0), ws3[2].stride(1),
            *ns, m_loc, k, lin, rank, chunk_rows, flag_base, grid, EVEN_K=k % p["bk"] == 0, **common)


def _gathered(call: _Gather, slots, gathered, side):
    """The all-gathered input, assembled by the copy engine off the critical path (for the
    consumers that queue no GEMM per source: `fused`, gemm=whole); the side stream waits for
    each peer's last flag itself.  The cuBLAS consumer starts these copies at its GEMMs
    instead (`_gather_landed`)."""
    last = len(call.pieces) - 1
    _gather_rows(call, slots, gathered, side, call.rt.rank)
    for src in call.rt.sources:  # pieces from one peer land in order: the last flag covers the slot
        call.rt.wait(side, data_index(call.half, src, last), 1, debug=call.debug, what="chunk", src=src, chunk=last)
        _gather_rows(call, slots, gathered, side, src)
    return gathered


def _gather_landed(call: _Gather, slots, gathered, side, stream, src: int, first: bool, own: bool = True) -> None:
    """Source src's rows into `gathered` (and this rank's own rows with the first source, unless
    `own` is off: _gather_own_early copies them), on the side stream once `stream` has seen them
    land: queued right before the GEMMs that read them, so the copies run while those GEMMs do.
    A device-local copy holds back the start of every kernel queued behind it on the GPU until it
    ends, whatever its stream (a kernel already running goes on), so it must start under a long
    kernel, not between two (docs/gpu-schedules.md#why-the-copy-engine-produces-and-cublas-consumes)."""
    call.rt.after(side, stream)
    if first and own:
        _gather_rows(call, slots, gathered, side, call.rt.rank)
    _gather_rows(call, slots, gathered, side, src)


def _gather_own_early(call: _Gather, slots, gathered, stream):
    """This rank's rows into `gathered` under the own shard's GEMM (env.gather_own_early): marks
    `stream` before that GEMM is queued and returns the copy, which the caller queues right after
    it, on the runtime's local copy stream (the side stream is busy with the pushes to the
    peers), so that the GEMM reaches the GPU first and the copy runs beside it; the caller's
    stream waits for the local stream at the call's end."""
    mark = call.rt.pooled_event("gather own", 0)
    driver.record(mark, stream)

    def copy() -> None:
        driver.wait_event(call.rt.local, mark)
        _gather_rows(call, slots, gathered, call.rt.local, call.rt.rank)

    return copy


def _gather_rows(call: _Gather, slots, gathered, side, src: int) -> None:
    """Rank src's rows of the all-gathered input, queued on `side`: one run of lin rows in
    every outer block of `gathered`, one 2-D copy (a contiguous one at outer == 1) from its
    shard (this rank's input, or its slot), addressed without a view of either."""
    rt, a2, lay = call.rt, call.a2, call.lay
    run = lay.lin * a2.shape[-1] * a2.element_size()  # bytes of one rank's rows in one outer block
    pitch = lay.world * run
    shard = a2.data_ptr() if src == rt.rank else slots.data_ptr() + src * lay.outer * run  # (M_loc, K) each
    if lay.outer == 1:
        driver.memcpy_async(side, gathered.data_ptr() + src * run, shard, run)
    elif pitch <= symm.MAX_PITCH:
        driver.memcpy2d_async(side, gathered.data_ptr() + src * run, pitch, shard, run, run, lay.outer)
    else:
        rt.copy(side, lay.block_rows(gathered.view(-1, a2.shape[-1]), src, 0, lay.local_rows),
                a2 if src == rt.rank else slots[src])


def _pad3(xs):
    return list(xs) + [xs[0]] * (3 - len(xs))
