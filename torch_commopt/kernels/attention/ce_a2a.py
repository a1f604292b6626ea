"""Ulysses's all-to-alls by the copy engine over symmetric memory, pipelined over head groups.

NCCL's all-to-alls do not overlap the attention on an H200: their kernels share the SMs with
cuDNN's, and their packing/unpacking copies queue on the compute stream
(docs/context-parallel-attention.md#ulysses-all-to-alls-by-the-copy-engine).  Here every piece
is one strided DMA (cuMemcpy2DAsync) written straight into its final place in the peer's
symmetric buffer:

  inputs, sequence -> heads (region IN): rank p's rows (b, head) of its S_loc tokens land at
      sequence offset p*S_loc of the destination's [B, h, S, D] tensors, which the attention
      then reads in place -- no packing, no unpacking, no SM;
  results, heads -> sequence (region OUT): the rows of the destination's token block go to a
      staging slot of the destination (the result tensors are ordinary memory, which a peer
      cannot write), which copies them into its output (one DMA per source); the own block
      goes straight to the output.

Group g's inputs travel while group g-1's attention runs, group g's results while group g+1's
runs.  Flags (symm.A2A_FREE / A2A_DATA, region r, half h = g % 2): before writing a peer's
slot (r, h) a rank takes its token for that slot (the peer gave it back once it had read what
was there), after writing it sets the peer's data flag; the reader waits for every source's
flag, reads, lowers its flags and gives every source its token back.  In OUT the flag counts the
results written so far (a peer's go in result order), so the reader copies result i out of its
slot as soon as every source has sent results 0..i, beside the pushes of the later ones (a
reader that waited for them all queued the backward's staged copies behind every push).  Stream
memory operations throughout (no spinning kernel, except debug mode's bounded waits); every flag
is back at rest after a call, so a CUDA graph may replay it once the buffer exists.

Transfers run on the group runtime's side stream, the own pieces' local copies beside them on
its local stream; the compute stream waits on flags and events only.

Concurrent groups (pure Ulysses only: its attention moves nothing itself;
TORCH_COMMOPT_ATTENTION_GROUP_STREAMS: "1" both passes (default), "fwd" the forward's only, "0"
neither): the odd head groups' attention runs on a second compute stream, so a group's kernel
starts on the SMs the previous group's last wave leaves idle instead of after it (split into
head groups on one stream, the attention alone takes longer than in one call).  Each group's
waits, release and results stay on its own stream; the outputs are completed on the caller's
stream, which joins the second one through the last group's events.  The backward's too, though
cuDNN's backward kernel fills the GPU (the second group's starts as the first's ends either way)
and then takes the SMs from the first group's small dq conversion queued behind it, so the first
group's results go out only after the whole second backward, in the exposed gap before the next
call: the backward on one stream ("fwd") measured slower anyway
(docs/context-parallel-attention.md#ulysses-all-to-alls-by-the-copy-engine).

Selected by TORCH_COMMOPT_ATTENTION_A2A (core/env.py; ce on CUDA by default, nccl to turn it
off; logged once); inside a CUDA-graph capture before the buffer exists, NCCL runs (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torch_commopt.core import env
from torch_commopt.kernels.attention import lane, switches

log = logging.getLogger(__name__)
ENV = env.ATTENTION_A2A
GROUP_STREAMS_ENV = env.ATTENTION_GROUP_STREAMS
_SECOND: dict[int, "torch.cuda.Stream"] = {}  # device index -> the second compute stream
PURPOSE = "attention all-to-all"  # the runtime's own_buffer key
IN, OUT = 0, 1  # flag regions
_ALIGN = 256  # bytes: every tensor's place in a slot starts aligned
Spec = tuple[Sequence[int], torch.dtype]


def _once(key: str, level: int, msg: str, *args) -> None:
    switches.once(log, key, level, msg, *args)


def transport() -> str:
    """The all-to-all transport the environment asks for (default ce; an unknown value is
    logged and read as nccl)."""
    return switches.transport(log, ENV, env.attention_a2a())


def _rows(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """(B, heads, seq, tail): a (B, H, S, *tail) tensor as rows (b, head) of seq * tail."""
    tail = 1
    for n in shape[3:]:
        tail *= n
    return shape[0], shape[1], shape[2], tail


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Layout:
    """Byte offsets of one half of the buffer: IN (this rank's [B, h/(G n), S, tail] inputs of a
    group) then OUT (per source, its [B, h/(G n), S_loc, tail] block of each result)."""

    def __init__(self, xs: Sequence[Tensor], outs: Sequence[Spec], groups: int, n: int) -> None:
        self.ins, off = [], 0
        for x in xs:
            b, h, s, t = _rows(x.shape)
            self.ins.append(off)
            off += _aligned(b * (h // (groups * n)) * s * n * t * x.element_size())
        self.outs, self.out_bytes = [], 0
        for shape, dtype in outs:
            b, h, s, t = _rows(shape)
            self.outs.append(self.out_bytes)
            self.out_bytes += _aligned(b * (h // (groups * n)) * s * t * dtype.itemsize)
        self.in_bytes = off
        self.half = _aligned(off + n * self.out_bytes)


def _rows_ok(x: Tensor) -> Tensor:
    """x with each (b, head) row's (seq, tail) contiguous (a copy only where it is not)."""
    shape, strides = x.shape, x.stride()
    if len(shape) < 3 or strides[2] != _rows(shape)[3] or strides[-1] != 1:
        return x.contiguous()
    expected = 1  # dims 2..: contiguous, a size-1 dim's stride free (as x[0, 0].is_contiguous() reads it)
    for size, stride in zip(reversed(shape[2:]), reversed(strides[2:])):
        if size != 1 and stride != expected:
            return x.contiguous()
        expected *= size
    return x


class _Geo:
    """One tensor's copy geometry, read once (the host path runs per head group and pass):
    its address, B, heads and tail as _rows reads them, element size and the batch / head
    strides in bytes."""

    __slots__ = ("ptr", "b", "h", "t", "elt", "batch", "head")

    def __init__(self, x: Tensor) -> None:
        self.b, self.h, _, self.t = _rows(x.shape)
        self.ptr, self.elt = x.data_ptr(), x.element_size()
        self.batch, self.head = x.stride(0) * self.elt, x.stride(1) * self.elt


def usable(xs: Sequence[Tensor], group, groups: int, outs: Sequence[Spec]) -> bool:
    """Whether the all-to-alls over `group` run here: asked for (transport() == "ce"), CUDA
    tensors, two or more ranks on one host with peer access (_agreed), and outside a CUDA-graph
    capture unless the buffer already exists (creating it is collective and synchronizes)."""
    if transport() != "ce" or group is None or group.size() < 2 or xs[0].device.type != "cuda":
        return False
    if torch.cuda.is_current_stream_capturing():
        from torch_commopt.kernels.gpu import peers, symm

        rt = symm.existing(group.group_name, xs[0].device) if peers.known(group.group_name) else None
        need = 2 * _Layout(xs, outs, groups, group.size()).half
        if rt is None or not rt.has_own_buffer(PURPOSE, need):
            _once("capture", logging.INFO, "commopt attention: copy-engine all-to-all buffer not yet allocated inside "
                  "a CUDA-graph capture; the all-to-alls run on NCCL (run a call outside the graph first)")
            return False
    elif not _agreed(group, xs[0].device):
        return False
    _once("on", logging.INFO, "commopt attention: Ulysses all-to-alls by the copy engine (%s=ce)", ENV)
    return True


def _agreed(group, device: torch.device) -> bool:
    """Whether every rank of `group` can take part (kernels/gpu/peers.py: one vote per group; a
    group across hosts keeps NCCL's all-to-alls, logged)."""
    from torch_commopt.kernels.gpu import peers

    ok, why = peers.agreed(group, device)
    if not ok:
        _once(f"refused {group.group_name}", logging.INFO, "commopt attention: group %s %s; its Ulysses all-to-alls "
              "stay on NCCL", group.group_name, why)
    return ok


def pipelined(xs: list[Tensor], compute: Callable, group, groups: int, outs: Sequence[Spec],
              keep_in: Sequence[Tensor] | None = None, keep_out: Sequence[Tensor] | None = None,
              concurrent: bool = False) -> tuple[Tensor, ...]:
    """schedules._pipelined's contract with copy-engine moves: compute(*head-sharded group
    inputs) per head group g (heads [g*h/G, (g+1)*h/G) of every x, split again over the n
    ranks), once per group in order, its results moved back into outputs shaped and typed as
    `outs` (sequence layout); keep_in / keep_out: (G, ...) tensors that receive group g's moved
    inputs / results at [g], copied by the local copy stream beside the compute.  concurrent:
    compute makes no collective calls, so the odd groups may run on a second stream (the caller
    has read GROUP_STREAMS_ENV for its pass: schedules._moved; module docstring)."""
    return _Pipeline(xs, group, groups, outs).run(compute, keep_in or (), keep_out or (),
                                                  second=concurrent and groups > 1 and group_streams())


def group_streams() -> bool:
    """Whether head groups the caller asked to run concurrently (group_streams_asked, for its
    pass) may do so here: not inside a CUDA-graph capture, where a second stream needs its own
    fork and join per capture."""
    return not torch.cuda.is_current_stream_capturing()


GROUP_STREAM_PASSES = {"0": (), "fwd": ("fwd",), "1": ("fwd", "bwd")}  # GROUP_STREAMS_ENV's values
GROUP_STREAMS_DEFAULT = env.ATTENTION_GROUP_STREAMS_DEFAULT


def group_stream_passes() -> tuple[str, ...]:
    """The passes ("fwd", "bwd") whose head groups GROUP_STREAMS_ENV, read per call, asks to run
    concurrently: "1" (default) both, "fwd" the forward's only, "0" neither; an unknown value is
    logged and read as the default."""
    want = env.attention_group_streams()
    if want not in GROUP_STREAM_PASSES:
        _once(f"bad {GROUP_STREAMS_ENV}={want}", logging.WARNING, "commopt attention: %s=%r is not one of %s; "
              "using %s", GROUP_STREAMS_ENV, want, tuple(GROUP_STREAM_PASSES), GROUP_STREAMS_DEFAULT)
        want = GROUP_STREAMS_DEFAULT
    return GROUP_STREAM_PASSES[want]


def group_streams_asked(backward: bool = False) -> bool:
    """Whether the forward's (backward=False) or the backward's head groups are asked to run
    concurrently (group_stream_passes; the cost model reads this too)."""
    return ("bwd" if backward else "fwd") in group_stream_passes()


def _sm_copy(stream, dst: Tensor, src: Tensor) -> None:
    """dst <- src by torch's copy kernel on `stream` (the protocol simulator records it as a
    copy of the rows it reads and writes)."""
    with torch.cuda.stream(stream):
        dst.copy_(src)


class _Back:
    """Group g's results on their way back (region OUT), piece by piece as the compute hands
    them over (push: after the compute stream's work so far): a peer's token block of a result
    goes into the peer's staging slot (its token taken before the first, its data flag set to
    the count of results sent after each), the own block straight into the output, a kept
    result's block into its kept tensor; close() returns the finish on the caller's compute
    stream (wait, copy the staged blocks in, release)."""

    def __init__(self, pipe: "_Pipeline", g: int, stream, keep_out: Sequence[Tensor]) -> None:
        self.p, self.g, self.stream = pipe, g, stream
        self.half = g % 2
        self.base = self.half * pipe.layout.half + pipe.layout.in_bytes
        self.left = {d: set(range(len(pipe.specs))) for d in [*pipe.rt.peers, pipe.me]}
        self.kept_geo = [_Geo(t[g]) for t in keep_out]

    def push(self, pieces: Sequence[tuple[int, int, Tensor]]) -> None:
        p, lay, s_loc = self.p, self.p.layout, self.p.seq_local
        ready = p._record(self.stream)
        for mover in (p.side, p.local):
            p._wait(mover, ready)
        for i, d, piece in sorted(pieces, key=lambda e: e[1] == p.me):  # the peers' first
            piece = _rows_ok(piece)
            o = p.out_geo[i]
            hr = o.h // (p.groups * p.n)
            want = (o.b, hr, s_loc) + tuple(p.specs[i][0][3:])
            if i not in self.left.get(d, ()) or piece.dtype != p.specs[i][1] or tuple(piece.shape) != want:
                raise RuntimeError(f"commopt attention all-to-all: piece {i} for rank {d}, {tuple(piece.shape)} "
                                   f"{piece.dtype}, is not one of {want} {p.specs[i][1]} still due")
            if d != p.me and i != min(self.left[d]):
                raise RuntimeError(f"commopt attention all-to-all: piece {i} for rank {d} comes before result "
                                   f"{min(self.left[d])}'s (a peer's pieces go in result order)")
            for mover in (p.side, p.local):
                piece.record_stream(mover)
            geo = _Geo(piece)
            if d == p.me:  # the own block: straight into the output, beside the pushes
                dst = o.ptr + (self.g * (o.h // p.groups) + p.me * hr) * o.head
                p._copy_rows(p.local, dst, o.head, o.batch, geo, range(hr), range(s_loc))
            else:
                if len(self.left[d]) == len(p.specs):
                    p._take(OUT, self.half, d, self.g)
                row = s_loc * o.t * geo.elt
                address = p.bases[d] + self.base + p.me * lay.out_bytes + lay.outs[i]
                p._copy_rows(p.side, address, row, hr * row, geo, range(hr), range(s_loc))
            if i < len(self.kept_geo):  # a kept result's block: into its (G, B, h, S, tail) tensor
                k = self.kept_geo[i]
                p._copy_rows(p.local, k.ptr + d * s_loc * k.t * k.elt, k.head, k.batch, geo, range(hr),
                             range(s_loc))
            self.left[d].discard(i)
            if d != p.me:  # results 0..i are in the peer's slot: it may copy them out
                p.rt.signal(p.side, d, p._data(OUT, self.half, p.me), i + 1)

    def close(self) -> Callable[[], None]:
        p, lay, s_loc = self.p, self.p.layout, self.p.seq_local
        missing = {d: sorted(left) for d, left in self.left.items() if left}
        if missing:
            raise RuntimeError(f"commopt attention all-to-all: group {self.g}'s compute left result pieces unsent "
                               f"(rank: result indices) {missing}")
        done = [p._record(p.side), p._record(p.local)]
        half, g = self.half, self.g
        on_sms = g == p.groups - 1  # the call's attention is done: nothing else wants the SMs

        def finish() -> None:
            # result i's staged blocks are copied in once every source has sent results 0..i, so
            # the copies of the first results run beside the pushes of the later ones; this
            # rank's own movers are joined after them (the copies do not read what they wrote).
            # The last group's by an SM kernel, twice the copy engine's speed within a GPU
            # (docs/context-parallel-attention.md#ulysses-all-to-alls-by-the-copy-engine), the
            # earlier ones' by the copy engine beside the next group's attention
            for i, (o, off) in enumerate(zip(p.out_geo, lay.outs)):
                p._arrived(OUT, half, g, p.compute, i + 1)
                hr = o.h // (p.groups * p.n)
                row = s_loc * o.t * o.elt
                block = (o.b, hr, s_loc) + tuple(p.specs[i][0][3:])  # a source's staged block
                for src in p.rt.sources:
                    staged = self.base + src * lay.out_bytes + off
                    first = g * (o.h // p.groups) + src * hr
                    if on_sms:
                        _sm_copy(p.compute, p.outs[i][:, first:first + hr],
                                 p.buf.view(p.me, staged, block, p.specs[i][1]))
                        continue
                    for bi in range(o.b):
                        p.driver.memcpy2d_async(p.compute, o.ptr + first * o.head + bi * o.batch, o.head,
                                                p.bases[p.me] + staged + bi * hr * row, row, row, hr)
            for event in done:
                p._wait(p.compute, event)
            p._release(OUT, half, p.compute)
        return finish


class _Pipeline:
    def __init__(self, xs: list[Tensor], group, groups: int, outs: Sequence[Spec]) -> None:
        from torch_commopt.kernels.gpu import driver, symm

        self.symm, self.driver = symm, driver
        self.xs = [_rows_ok(x) for x in xs]
        self.groups, self.specs = groups, list(outs)
        self.rt = rt = symm.runtime(group.group_name, xs[0].device)
        self.n, self.me = rt.world, rt.rank
        self.layout = _Layout(self.xs, self.specs, groups, self.n)
        self.buf = rt.own_buffer(PURPOSE, 2 * self.layout.half)
        self.bases = [self.buf.address(r, 0) for r in range(self.n)]  # this rank's own: its tensor's address
        self.debug = rt.debug_waits()
        self.watched = None  # run()'s call under the watchdog
        self.compute, self.side, self.local = torch.cuda.current_stream(xs[0].device), rt.side, rt.local
        self.outs = [torch.empty(shape, dtype=dtype, device=xs[0].device) for shape, dtype in self.specs]
        self.seq_local = s_loc = self.xs[0].shape[2]
        self.in_read = [None, None]  # per half: compute-stream event after the last read of the IN slot
        self._next_event = 0  # this call's next event of the runtime's pool (_record)
        # what every group-pass reads again: the inputs' and outputs' geometry, the moved views'
        # shapes, each result's expected shape (per tensor, heads per rank and group: x.h // (G n))
        self.x_geo, self.out_geo = [_Geo(x) for x in self.xs], [_Geo(o) for o in self.outs]
        gn = groups * self.n
        self.in_views = [((g.b, g.h // gn, s_loc * self.n) + tuple(x.shape[3:]), x.dtype)
                         for g, x in zip(self.x_geo, self.xs)]
        self.result_shapes = [(g.b, g.h // gn, s_loc * self.n) + tuple(shape[3:])
                              for g, (shape, _) in zip(self.out_geo, self.specs)]

    # ---- events -----------------------------------------------------------------------------
    def _record(self, stream) -> int:
        """An event (a driver handle from the runtime's pool for this purpose) recorded on
        `stream` now.  Each event of the pool is recorded once per call and waited on only within
        the call, and a wait binds to the record queued before it, so the next call may record
        it again; a raw driver event costs the host a fraction of a torch.cuda.Event, and a
        call records ~17 per head-group pass."""
        event = self.rt.pooled_event(PURPOSE, self._next_event)
        self._next_event += 1
        self.driver.record(event, stream)
        return event

    def _wait(self, stream, event: int) -> None:
        self.driver.wait_event(stream, event)

    # ---- flags ------------------------------------------------------------------------------
    def _free(self, region: int, half: int, peer: int) -> int:
        return self.symm.A2A_FREE + (region * self.symm.HALVES + half) * self.symm.MAX_WORLD + peer

    def _data(self, region: int, half: int, src: int) -> int:
        return self.symm.A2A_DATA + (region * self.symm.HALVES + half) * self.symm.MAX_WORLD + src

    def _take(self, region: int, half: int, peer: int, g: int) -> None:
        """Side stream: hold until peer's slot (region, half) is free, and take its token."""
        index = self._free(region, half, peer)
        self.rt.wait(self.side, index, 1, debug=self.debug, watched=self.watched, what="free all-to-all slot", src=peer, chunk=g)
        self.driver.write_value32(self.side, self.rt.flag_address(self.me, index), 0)

    def _drained(self) -> None:
        """Side stream, before a call's first push: hold until every peer has read all it was
        sent before (each of its four slots' tokens back), without taking them.  A slot's
        token guards its bytes under one call's layout, but the layout follows the call's
        tensors (a forward sends q, k, v and gets out back, its backward sends dout and gets
        dq, dk, dv), so a push of this call into one slot can land on bytes a peer still reads
        as another slot of the call before -- the protocol simulator showed a push into IN
        half 1 landing on the OUT half 0 a peer had not yet copied out (and the GPU test's plain
        backward over two head groups came out wrong)."""
        for peer in self.rt.peers:
            for region in (IN, OUT):
                for half in range(self.symm.HALVES):
                    self.rt.wait(self.side, self._free(region, half, peer), 1, debug=self.debug, watched=self.watched,
                                 what="free all-to-all slot", src=peer, chunk=-1)

    def _arrived(self, region: int, half: int, g: int, stream, count: int = 1) -> None:
        """`stream` (a compute stream): hold until every source has written this rank's slot
        (region, half) -- for OUT, its first `count` results (the data flag counts them)."""
        for src in self.rt.sources:
            self.rt.wait(stream, self._data(region, half, src), count, debug=self.debug, watched=self.watched,
                         what="all-to-all piece", src=src, chunk=g)

    def _release(self, region: int, half: int, stream) -> None:
        """`stream` (a compute stream), after the last read of slot (region, half): flags down,
        tokens back."""
        for src in self.rt.sources:
            self.driver.write_value32(stream, self.rt.flag_address(self.me, self._data(region, half, src)), 0)
        for src in self.rt.sources:
            self.rt.signal(stream, src, self._free(region, half, self.me), 1)

    # ---- copies -----------------------------------------------------------------------------
    def _copy_rows(self, stream, dst: int, dst_row: int, dst_batch: int, src: _Geo, heads: range,
                   tokens: range) -> None:
        """Rows (b, heads[j]), tokens `tokens` of src -> dst + b*dst_batch + j*dst_row (bytes),
        one DMA per batch (heads and tokens: ranges of step 1)."""
        width = len(tokens) * src.t * src.elt
        # one row: its pitch is never used, but the driver wants pitch >= width (a size-1 dim's
        # stride can be anything)
        src_row, dst_row = (src.head, dst_row) if len(heads) > 1 else (width, width)
        at = src.ptr + heads.start * src.head + tokens.start * src.t * src.elt
        for b in range(src.b):
            self.driver.memcpy2d_async(stream, dst + b * dst_batch, dst_row, at + b * src.batch, src_row, width,
                                       len(heads))

    def _inbound(self, g: int, start) -> Callable[[], list[Tensor]]:
        """Push group g's inputs to every rank (own piece included); returns the compute-side
        wait giving this rank's [B, h, S, tail] views of its IN slot."""
        half, lay, s_loc, n = g % 2, self.layout, self.seq_local, self.n
        base = half * lay.half
        for stream in (self.side, self.local):
            self._wait(stream, start)
        if self.in_read[half] is not None:  # the own piece overwrites what group g-2 read
            self._wait(self.local, self.in_read[half])
        for d in [*self.rt.peers, self.me]:
            stream = self.side if d != self.me else self.local  # the own piece beside the pushes
            if d != self.me:
                self._take(IN, half, d, g)
            for x, off in zip(self.x_geo, lay.ins):
                hd = x.h // (self.groups * n)
                block = s_loc * x.t * x.elt  # one source's tokens of a row
                first = g * (x.h // self.groups) + d * hd
                self._copy_rows(stream, self.bases[d] + base + off + self.me * block, n * block, hd * n * block, x,
                                range(first, first + hd), range(s_loc))
            if d != self.me:
                self.rt.signal(self.side, d, self._data(IN, half, self.me), 1)
        done = [self._record(self.side), self._record(self.local)]

        def wait(stream) -> list[Tensor]:
            for event in done:
                self._wait(stream, event)
            self._arrived(IN, half, g, stream)
            return [self.buf.view(self.me, base + off, shape, dtype) for (shape, dtype), off in zip(self.in_views,
                                                                                                  lay.ins)]
        return wait

    def _own(self, g: int) -> list[Tensor]:
        """This rank's own pieces of group g's inputs ([B, h/(G n), S_loc, tail] views of the
        caller's tensors): what a staged compute's early part reads before anything arrives."""
        own = []
        for x, geo in zip(self.xs, self.x_geo):
            hd = geo.h // (self.groups * self.n)
            first = g * (geo.h // self.groups) + self.me * hd
            own.append(x[:, first:first + hd])
        return own

    def _whole(self, results: list[Tensor]) -> list[tuple[int, int, Tensor]]:
        """A plain compute's results as pieces (result index, destination, its token block)."""
        s_loc = self.seq_local
        results = [_rows_ok(r) for r in results]
        for r, (shape, dtype), want in zip(results, self.specs, self.result_shapes):
            if r.dtype != dtype or tuple(r.shape) != want:
                raise RuntimeError(f"commopt attention all-to-all: result {tuple(r.shape)} {r.dtype} does not match "
                                   f"output {tuple(shape)} {dtype} over {self.groups} head groups of {self.n} ranks")
        # result by result (each to every rank): a reader copies result i in once every
        # source has sent it (_Back)
        return [(i, d, r[:, :, d * s_loc:(d + 1) * s_loc]) for i, r in enumerate(results)
                for d in [*self.rt.peers, self.me]]

    def _keep(self, kept: Sequence[Tensor], g: int, tensors: Sequence[Tensor], stream):
        """Local copy stream: tensors -> kept[i][g], after `stream`'s work so far (the compute
        stream of group g: they are in the IN slot, arrived, or results just computed); returns
        the copies' event."""
        if not kept:
            return None
        self._wait(self.local, self._record(stream))
        for dst, src in zip(kept, tensors):
            src.record_stream(self.local)
            self.rt.copy(self.local, dst[g], src)
        return self._record(self.local)

    def run(self, compute, keep_in: Sequence[Tensor] = (), keep_out: Sequence[Tensor] = (),
            second: bool = False) -> tuple[Tensor, ...]:
        """second: the odd groups' compute on the second compute stream (module docstring).
        compute: a callable on the moved inputs, or a staged compute (pipelined)."""
        self.watched = self.rt.begin_call("cp attention all-to-all", label=f"copy-engine all-to-all, {self.groups} groups")
        try:
            return self._run(compute, keep_in, keep_out, second)
        finally:
            self.rt.end_call(self.watched)
            self.watched = None

    def _run(self, compute, keep_in, keep_out, second) -> tuple[Tensor, ...]:
        staged = hasattr(compute, "rest")
        for x in self.xs:
            x.record_stream(self.side)
            x.record_stream(self.local)
        start = self._record(self.compute)
        streams = [self.compute]
        if second:  # it starts where the caller's stream is: what compute reads besides the moved inputs
            streams.append(lane.device_stream(_SECOND, self.xs[0].device))
            self._wait(streams[1], start)
        self._drained()
        pending, backs = self._inbound(0, start), []
        for g in range(self.groups):
            stream = streams[g % len(streams)]
            if staged:  # the own block's attention, queued before the wait for the peers' pieces
                with torch.cuda.stream(stream):
                    compute.early(g, self._own(g))
            moved = pending(stream)
            kept_in = self._keep(keep_in, g, moved, stream)  # before the next group's own pieces on the local stream
            if g + 1 < self.groups:
                pending = self._inbound(g + 1, start)
            back = _Back(self, g, stream, keep_out)
            with torch.cuda.stream(stream):
                if staged:
                    for pieces in compute.rest(g, moved):
                        back.push(pieces)
                else:
                    back.push(self._whole(list(compute(*moved))))
            if kept_in is not None:  # the slot is read by the copies too
                self._wait(stream, kept_in)
            self._release(IN, g % 2, stream)  # stream-ordered after the compute's reads of the slot
            self.in_read[g % 2] = self._record(stream)
            del moved
            # the caller's stream joins the second through each group's outbound events (finish)
            backs.append(back.close())
            if g >= 1:
                backs[g - 1]()
        backs[-1]()
        if self.debug:
            self.rt.check_status("cp attention all-to-all")
        return tuple(self.outs)
