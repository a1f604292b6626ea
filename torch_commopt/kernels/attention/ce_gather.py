"""The flex all-gather schedule's K/V all-gather and dK/dV reduce-scatter by the copy engine.

NCCL's all-gather of K and V (and the reduce-scatter of their gradients) costs the all-gather
schedule three things a call (docs/flex-attention.md#where-a-calls-time-goes): its kernels (an
NCCL kernel per tensor and pass, on SMs), the copies that merge the rank-major buffer into the
sequence-major [B, H, S, D] tensor flex reads (and split the gradients back out), and its host
time (an NCCL call costs the host about ten times a driver call).  Here a rank's block moves as
one DMA per tensor into each peer's symmetric buffer, and lands in its final place with one 2-D
DMA (the block's B * H rows at the gathered tensor's pitch):

  all-gather: the side stream pushes this rank's K and V (contiguous [B, H, L, D]) into every
      peer's slot `rank` of buffer half h, then sets the peer's DATA[h, rank, 0]; the local copy
      stream copies this rank's own block into the gathered tensors, then, once DATA[h, src, 0]
      is set, each source's block out of its slot; the caller's stream joins both and gives the
      slots back (done_reading).
  reduce-scatter: the side stream pushes each peer's rows of the gathered gradients (a 2-D DMA
      out of [B, H, S, D]) into the peer's slot `rank`; the caller's stream waits for every
      source's flag and sums this rank's own rows with the slots' (in float32 from three ranks
      on, in the gradients' dtype, one rounding, over two as NCCL's sum of two does), then gives
      the slots back.

  pulled all-gather (two ranks, TORCH_COMMOPT_FLEX_GATHER_CUT, experimental): the side stream
      takes the peer's token, copies this rank's K and V into its *own* slot `rank` of half h and
      sets the peer's DATA[h, rank, 0]; the local stream, once DATA[h, peer, 0] is set, copies out
      of the peer's slot only the keys this rank's rows keep tiles of (`spans`: flex kernels read
      no key block outside them, so the rest of the gathered tensors is left unwritten); then as
      the all-gather.  Two ranks only, as ce_pull (Schedule.at_world): over more, a third rank's
      pushes into a peer's half are guarded by no token of the rank still pulling from it.
  cut reduce-scatter (two ranks, the same switch): as the reduce-scatter, but each rank pushes
      only the span of the peer's rows of dK/dV that its own rows reached (elsewhere its
      gradients of those keys are zero), its span ahead of them in the slot's header; the
      receiver adds the slot's rows within the header's span to its own on the device.

The protocol is the matmul schedules' (kernels/gpu/symm.py: shared buffer size classes, halves
alternating call by call, DATA flags, FREE tokens), so these calls interleave with theirs.
On by default (TORCH_COMMOPT_ATTENTION_TRANSPORT auto or ce; nccl turns it off): it measured
faster than NCCL's moves at every mask (docs/flex-attention.md); one head group only, outside
CUDA-graph captures, and on groups whose ranks agreed on peer access (kernels/gpu/peers.py);
otherwise NCCL runs.
"""

from __future__ import annotations

import collections
import logging

import torch
from torch import Tensor

from torch_commopt.kernels.attention import switches

log = logging.getLogger(__name__)
_ALIGN = 256  # bytes: V starts aligned in its slot
STATS = {"pulled": 0, "cut scatter": 0}  # cut moves run in this process (all_gather_kv_pulled, reduce_scatter_kv_cut)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def usable(tensors: list[Tensor], group) -> bool:
    """Whether the K/V moves of the all-gather schedule over `group` run on the copy engine:
    asked for (ce_ring.transport() "ce" or "auto", the default), contiguous CUDA tensors, two or
    more ranks that agreed on peer access, and not inside a CUDA-graph capture (a new buffer's
    rendezvous is collective and synchronizes; the capture keeps NCCL, logged once)."""
    from torch_commopt.kernels.attention import ce_ring

    if ce_ring.transport() == "nccl" or group is None or group.size() < 2:
        return False
    if any(t.device.type != "cuda" or not t.is_contiguous() for t in tensors):
        return False
    if torch.cuda.is_current_stream_capturing():
        switches.once(log, "capture", logging.INFO, "commopt flex all-gather: inside a CUDA-graph capture the K/V "
                      "moves run on NCCL")
        return False
    from torch_commopt.kernels.gpu import peers

    ok, why = peers.agreed(group, tensors[0].device)
    if not ok:
        switches.once(log, f"refused {group.group_name}", logging.INFO, "commopt flex all-gather: group %s %s; its K/V "
                      "moves stay on NCCL", group.group_name, why)
        return False
    switches.once(log, "on", logging.INFO, "commopt flex all-gather: K/V moves by the copy engine (%s=%s)",
                  ce_ring.ENV, ce_ring.transport())
    return True


class _Call:
    """One call's runtime, buffer half, slot size and streams; a context watched by the runtime's
    watchdog from its start to its end, whatever happens between.  A slot holds the two tensors'
    pieces and, after them, `header` bytes."""

    def __init__(self, group, tensors: list[Tensor], what: str, header: int = 0) -> None:
        from torch_commopt.kernels.gpu import driver, symm

        self.symm, self.driver = symm, driver
        self.rt = rt = symm.runtime(group.group_name, tensors[0].device)
        self.per = [t.numel() * t.element_size() // rt.world if what == "scatter" else t.numel() * t.element_size()
                    for t in tensors]
        self.offsets = [0, _aligned(self.per[0])]
        self.offsets.append(_aligned(self.offsets[1] + self.per[1]))  # a header (cut reduce-scatter) after both
        self.slot = _aligned(self.offsets[2] + header)
        self.buf = rt.buffer(2 * rt.world * self.slot)  # both halves (SymmAllocError on every rank alike)
        self.half = rt.next_epoch() % 2
        self.base = self.half * (self.buf.nbytes // 2)
        self.debug = rt.debug_waits()
        self.cur = torch.cuda.current_stream(tensors[0].device)
        self.watched = rt.begin_call(f"flex all-gather {what}", label=f"copy-engine {what} of K/V")

    def slot_address(self, rank: int, src: int, i: int) -> int:
        """Rank `rank`'s slot of source `src`, tensor i's place in it (device address)."""
        return self.buf.address(rank, self.base + src * self.slot + self.offsets[i])

    def __enter__(self) -> "_Call":
        return self

    def __exit__(self, *exc) -> None:
        self.rt.end_call(self.watched)

    def landed(self, stream, src: int) -> None:
        """`stream` holds until source src's block has landed in this rank's half."""
        self.rt.wait(stream, self.symm.data_index(self.half, src, 0), 1, debug=self.debug, what="chunk", src=src,
                     chunk=0)

    def arrived(self, stream) -> None:
        """`stream` holds until every source's block has landed in this rank's half."""
        for src in self.rt.sources:
            self.landed(stream, src)

    def finish(self, op: str) -> None:
        """After the caller's stream's last read of the slots: flags down, tokens back."""
        self.rt.done_reading(self.cur, self.half, 1)
        if self.debug:
            self.rt.check_status(op)


def _block_rows(t: Tensor) -> tuple[int, int]:
    """(rows, bytes a row) of a [B, H, L, D] block: its B * H rows of L * D elements."""
    return t.shape[0] * t.shape[1], t.shape[2] * t.shape[3] * t.element_size()


def _start_gather(call: _Call, k: Tensor, v: Tensor) -> tuple[list[Tensor], int, int, int]:
    """(gathered K and V [B, H, W * L, D], their B * H rows, a block row's bytes, a gathered row's):
    allocated before the streams sync with the caller's, then the own block copied into place on
    the local stream, beside whatever the side stream moves."""
    rt, driver = call.rt, call.driver
    outs = [t.new_empty(t.shape[:2] + (rt.world * t.shape[2], t.shape[3])) for t in (k, v)]
    rows, width = _block_rows(k)
    pitch = rt.world * width
    rt.after(rt.side, call.cur)
    rt.after(rt.local, call.cur)
    for i, t in enumerate((k, v)):
        driver.memcpy2d_async(rt.local, outs[i].data_ptr() + rt.rank * width, pitch, t.data_ptr(), width, width, rows)
    return outs, rows, width, pitch


def all_gather_kv(k: Tensor, v: Tensor, group) -> tuple[Tensor, Tensor]:
    """(K, V) of the whole sequence, [B, H, W * L, D], from every rank's contiguous [B, H, L, D]
    blocks (usable() first)."""
    with _Call(group, [k, v], "gather") as call:
        rt, driver = call.rt, call.driver
        outs, rows, width, pitch = _start_gather(call, k, v)
        for p in rt.peers:
            rt.acquire(rt.side, p, call.half, debug=call.debug, defer_take=True)  # taken with the signal
            for i, t in enumerate((k, v)):
                driver.memcpy_async(rt.side, call.slot_address(p, rt.rank, i), t.data_ptr(), call.per[i])
            rt.signal(rt.side, p, call.symm.data_index(call.half, rt.rank, 0), 1)
        for src in rt.sources:
            call.landed(rt.local, src)
            for i in range(2):
                driver.memcpy2d_async(rt.local, outs[i].data_ptr() + src * width, pitch,
                                      call.slot_address(rt.rank, src, i), width, width, rows)
        rt.after(call.cur, rt.local)
        rt.after(call.cur, rt.side)  # k and v are read by the pushes: the caller may free them after this
        call.finish("flex all-gather of K/V")
    return outs[0], outs[1]


def all_gather_kv_pulled(k: Tensor, v: Tensor, group, spans: list) -> tuple[Tensor, Tensor]:
    """all_gather_kv over two ranks, each pulling from the peer's slot only spans[peer]: (start,
    end) tokens of the peer's block, or None for none of it (the module docstring's pulled
    all-gather).  The gathered tensors hold garbage outside the spans and the own block."""
    with _Call(group, [k, v], "gather") as call:
        rt, driver = call.rt, call.driver
        if rt.world != 2:
            raise ValueError(f"commopt flex all-gather: a pulled gather runs over two ranks, not {rt.world}")
        STATS["pulled"] += 1
        outs, rows, width, pitch = _start_gather(call, k, v)
        token_bytes = k.shape[3] * k.element_size()
        (peer,) = rt.peers
        # a write into this rank's own half: after the peer's token (its pulls of the half are done)
        rt.acquire(rt.side, peer, call.half, debug=call.debug, defer_take=True)  # taken with the signal
        for i, t in enumerate((k, v)):
            driver.memcpy_async(rt.side, call.slot_address(rt.rank, rt.rank, i), t.data_ptr(), call.per[i])
        rt.signal(rt.side, peer, call.symm.data_index(call.half, rt.rank, 0), 1)
        call.landed(rt.local, peer)  # waited for even when nothing is pulled: every flag back at rest
        if spans[peer] is not None:
            start, end = (x * token_bytes for x in spans[peer])
            for i in range(2):
                driver.memcpy2d_async(rt.local, outs[i].data_ptr() + peer * width + start, pitch,
                                      call.slot_address(peer, peer, i) + start, width, end - start, rows)
        rt.after(call.cur, rt.local)
        rt.after(call.cur, rt.side)  # k and v are read by the publishing copies
        call.finish("flex pulled all-gather of K/V")
    return outs[0], outs[1]


_AGREED: dict[str, bool] = {}


def cut_agreed(group) -> bool:
    """Whether this group pulls cut gathers (env.flex_gather_cut): asked for on this rank and, at
    the group's first call, on every rank of it (a vote through the c10d store: a rank that pulls
    while its peer pushes would read slots nobody wrote).  A disagreement is logged; the group
    then gathers whole."""
    from torch_commopt.core import consistency, env

    if not env.flex_gather_cut():
        return False
    if group.group_name not in _AGREED:
        decision = consistency.Decision("flex gather cut", group.group_name, consistency.digest(["flex gather cut"]),
                                        "the flex all-gather's pulled K/V gather")
        outcome = consistency.agree(decision, "on", env.agree_timeout_s())
        _AGREED[group.group_name] = outcome.agreed and outcome.value == "on"
        if not _AGREED[group.group_name]:
            log.warning("commopt flex all-gather: %s=1 is not set on every rank of group %s (%s); its K/V gathers stay "
                        "whole", env.FLEX_GATHER_CUT, group.group_name, outcome.detail)
    return _AGREED[group.group_name]


def reduce_scatter_kv(gk: Tensor, gv: Tensor, group) -> tuple[Tensor, Tensor]:
    """This rank's rows of dK and dV summed over ranks, [B, H, L, D] in their dtypes, from every
    rank's contiguous [B, H, W * L, D] gradients (usable() first)."""
    with _Call(group, [gk, gv], "scatter") as call:
        rt, driver, world = call.rt, call.driver, call.rt.world
        length = gk.shape[2] // world
        rows, width = gk.shape[0] * gk.shape[1], length * gk.shape[3] * gk.element_size()
        rt.after(rt.side, call.cur)
        for p in rt.peers:
            rt.acquire(rt.side, p, call.half, debug=call.debug, defer_take=True)
            for i, g in enumerate((gk, gv)):
                driver.memcpy2d_async(rt.side, call.slot_address(p, rt.rank, i), width, g.data_ptr() + p * width,
                                      world * width, width, rows)
            rt.signal(rt.side, p, call.symm.data_index(call.half, rt.rank, 0), 1)
        call.arrived(call.cur)
        sums = []
        for i, g in enumerate((gk, gv)):
            shape = g.shape[:2] + (length, g.shape[3])
            parts = [g[:, :, rt.rank * length:(rt.rank + 1) * length]]
            parts += [call.buf.view(rt.rank, call.base + src * call.slot + call.offsets[i], shape, g.dtype)
                      for src in rt.sources]
            sums.append(_sum(parts, g.dtype))
        rt.after(call.cur, rt.side)  # the gradients are read by the pushes
        call.finish("flex reduce-scatter of dK/dV")
    return sums[0], sums[1]


def reduce_scatter_kv_cut(gk: Tensor, gv: Tensor, group, sent: tuple | None) -> tuple[Tensor, Tensor]:
    """reduce_scatter_kv over two ranks, pushing only what is not zero (the module docstring's cut
    reduce-scatter): `sent`, (start, end) tokens of the peer's share that this rank's rows keep
    tiles of, or None for none of it -- outside it this rank's gradients of those keys are zero
    (flex writes zero for a key block no row reaches).  The span travels ahead of the rows in the
    slot's header, so the receiver sums the peer's rows within it on the device, whatever its host
    knows of the peer's mask (a compiled program's mask is its own rows')."""
    with _Call(group, [gk, gv], "scatter", header=_HEADER) as call:
        rt, driver = call.rt, call.driver
        if rt.world != 2:
            raise ValueError(f"commopt flex reduce-scatter: a cut reduce-scatter runs over two ranks, not {rt.world}")
        STATS["cut scatter"] += 1
        length = gk.shape[2] // 2
        rows, width = gk.shape[0] * gk.shape[1], length * gk.shape[3] * gk.element_size()
        token_bytes = gk.shape[3] * gk.element_size()
        (peer,) = rt.peers
        header = _span_header(sent, gk.device)
        rt.after(rt.side, call.cur)
        rt.acquire(rt.side, peer, call.half, debug=call.debug, defer_take=True)
        driver.memcpy_async(rt.side, call.slot_address(peer, rt.rank, 2), header.data_ptr(), _HEADER)
        if sent is not None:
            start, end = (x * token_bytes for x in sent)
            for i, g in enumerate((gk, gv)):
                driver.memcpy2d_async(rt.side, call.slot_address(peer, rt.rank, i) + start, width,
                                      g.data_ptr() + peer * width + start, 2 * width, end - start, rows)
        rt.signal(rt.side, peer, call.symm.data_index(call.half, rt.rank, 0), 1)
        call.arrived(call.cur)
        at = call.base + peer * call.slot
        inside = _inside(call.buf.view(rt.rank, at + call.offsets[2], (2,), torch.int32), length)
        sums = []
        for i, g in enumerate((gk, gv)):
            own = g[:, :, rt.rank * length:(rt.rank + 1) * length]
            slot = call.buf.view(rt.rank, at + call.offsets[i], g.shape[:2] + (length, g.shape[3]), g.dtype)
            sums.append(_sum_within(own, slot, inside))
        rt.after(call.cur, rt.side)  # the gradients and the header are read by the pushes
        call.finish("flex cut reduce-scatter of dK/dV")
    return sums[0], sums[1]


_HEADER = 8  # bytes: a cut reduce-scatter's span, int32 (start, end) tokens
_HEADERS: collections.OrderedDict = collections.OrderedDict()  # span headers on devices, the latest few
_TOKENS: dict[tuple, Tensor] = {}


def _span_header(sent: tuple | None, device) -> Tensor:
    """The span as the int32 (start, end) a slot's header holds ((0, 0): none), on the device: one
    for each of the last 64 spans (a mask each batch makes a new one; a header dropped here is freed
    on the caller's stream, which the call joins with the side stream that copies it)."""
    key = (sent, str(device))
    if key not in _HEADERS:
        _HEADERS[key] = torch.tensor(sent or (0, 0), dtype=torch.int32, device=device)
        if len(_HEADERS) > 64:
            _HEADERS.popitem(last=False)
    _HEADERS.move_to_end(key)
    return _HEADERS[key]


def _tokens(length: int, device) -> Tensor:
    """int32 0 .. length - 1 on the device, made once per length and device."""
    key = (length, str(device))
    if key not in _TOKENS:
        _TOKENS[key] = torch.arange(length, dtype=torch.int32, device=device)
    return _TOKENS[key]


def _inside(span: Tensor, length: int) -> Tensor:
    """[length, 1] bool: the tokens within span (int32 (start, end), read on the device)."""
    tokens = _tokens(length, span.device)
    return ((tokens >= span[0]) & (tokens < span[1]))[:, None]


def _sum_within(own: Tensor, slot: Tensor, inside: Tensor) -> Tensor:
    """own + slot over the tokens (dim 2) `inside` holds ([tokens, 1] bool, _inside), own elsewhere
    (the slot there holds whatever was last written in it): one sum of two, rounded once, in own's
    dtype."""
    return torch.add(own, torch.where(inside, slot, 0.0))


def _sum(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The parts' sum in `dtype`: two added as one rounding (a sum of two in float32, rounded
    once, as NCCL's), more accumulated in float32 and rounded at the end."""
    if len(parts) == 2:
        return torch.add(parts[0], parts[1])
    acc = parts[0].float()
    for part in parts[1:]:
        acc.add_(part)
    return acc.to(dtype)
