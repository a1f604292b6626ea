"""by_expert's transfers by the copy engine over symmetric memory.

NCCL's all-to-alls run as kernels on the SMs, beside the experts' grouped GEMMs; an NCCL collective
beside cuBLAS barely overlaps on an H200 (the tuner's calibration, docs/tuner.md).  Here every piece
is one DMA (cuMemcpyDtoDAsync) written straight into the receiver's symmetric buffer by the copy
engine, on the group runtime's side stream, signalled by a flag (kernels/gpu/symm.py); the compute
stream waits on flags only (stream memory operations, no spinning kernel).

Layout: each rank's buffer has two regions, IN (tokens arriving at their experts) and OUT (outputs
arriving home), each with one slot per source, `slot` bytes (the call's peak rows a rank routes,
Routing.peak, rounded up to a power of two so that the buffer is not regrown every call).  Source
p writes its pieces for this rank into slot p in chunk order: chunk c's rows follow chunks 0..c-1's,
and both ends know every size from the Routing, so no offset travels.

Flags (symm.MOE_FREE / MOE_DATA, per region): before its first write into a peer's region in a
call, a rank takes its token for it (the peer gave it back once it had read all it was sent the
call before); after writing chunk c it sets the peer's data flag to c + 1.  The reader waits for
each source's flag >= c + 1, copies chunk c's rows out, and after the call's last read of the
region lowers its flags and gives every source its token back.  Every flag is back at rest after
the call (tests/kernels/test_moe_ce_protocol.py runs the protocol on the CPU).

A call (one pass of by_expert, forward or backward) is watched by the GPU-wait watchdog
(kernels/gpu/watchdog.py) and its waits are bounded in debug mode, like every GPU schedule's.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from torch_commopt.core import env
from torch_commopt.kernels.moe.runs import copy_runs2

log = logging.getLogger(__name__)
PURPOSE = "moe exchange"  # the runtime's own_buffer key
IN, OUT = 0, 1
_told: set[str] = set()


def _once(key: str, level: int, msg: str, *args) -> None:
    if key not in _told:
        _told.add(key)
        log.log(level, msg, *args)


def slot_bytes(peak_rows: int, row_bytes: int) -> int:
    """A source's slot: the peak rows rounded up to a power of two (at least 256), in bytes."""
    rows = 256
    while rows < peak_rows:
        rows *= 2
    return rows * row_bytes


def usable(x: Tensor, group) -> bool:
    """Whether by_expert's transfers over `group` run by the copy engine: asked for
    (TORCH_COMMOPT_MOE_TRANSPORT, default ce), CUDA tensors, two or more ranks that all can map
    each other's memory (kernels/gpu/peers.py, voted once per group), outside a CUDA-graph
    capture (the buffer may have to grow, which is collective and synchronizes).  Every input is
    the same on every rank, so every rank answers the same."""
    want = env.moe_transport()
    if want not in ("ce", "nccl"):
        _once(f"bad {want}", logging.WARNING, "commopt moe: %s=%r is not ce or nccl; using nccl", env.MOE_TRANSPORT, want)
        return False
    if want != "ce" or group is None or group.size() < 2 or not x.is_cuda:
        return False
    if torch.cuda.is_current_stream_capturing():
        _once("capture", logging.INFO, "commopt moe: inside a CUDA-graph capture the exchange runs on NCCL")
        return False
    from torch_commopt.kernels.gpu import peers

    ok, why = peers.agreed(group, x.device)
    if not ok:
        _once(f"refused {group.group_name}", logging.INFO, "commopt moe: group %s %s; its exchange stays on NCCL",
              group.group_name, why)
        return False
    _once("on", logging.INFO, "commopt moe: by_expert's exchange by the copy engine (%s=ce)", env.MOE_TRANSPORT)
    return True


def _read(stream, dst: Tensor, src: Tensor) -> None:
    """Copy a landed piece out of the symmetric buffer (on the compute stream, the current one);
    the protocol tests record it as a read of the slot (tests/kernels/fake_cuda.py)."""
    dst.copy_(src)


def read_rows2(stream, dst: Tensor, runs, own: Tensor, slots: Tensor) -> None:
    """dst's rows <- this rank's own piece's and the landed pieces' by one run table (runs.copy_runs2:
    negative source rows read `slots`, this rank's buffer as rows), on the compute stream; the
    protocol tests record it as reads of exactly the runs' rows."""
    copy_runs2(dst, own, slots, runs)


class Arrival:
    """Chunk c of a region, posted: `wait()` holds the compute stream until every source's piece
    has landed and copies the pieces into the caller's views; `place()` (a post without outs)
    holds it the same way and moves every piece from where it lies -- this rank's own piece as it
    was given, the peers' in their slots -- straight into the caller's buffer by one run table:
    one launch a chunk however many sources (kernels/moe/runs.copy_runs2)."""

    def __init__(self, ex: "CEExchange", region: int, chunk: int, outs: list[Tensor] | None, own: Tensor):
        self.ex, self.region, self.chunk, self.outs, self.own = ex, region, chunk, outs, own

    def wait(self) -> None:
        self.ex.arrive(self.region, self.chunk, self.outs)

    def place(self, dst: Tensor, runs, rows: list[int], at_slot: list[int]) -> None:
        """dst's rows <- every source's piece by one run table (by_expert.Tables.placed: this rank's
        own piece as it was given, the peers' where they lie in their slots), once landed;
        rows[src]: what src sent in this chunk (the Routing's sizes); at_slot[src]: the slot row
        the table has src's piece at, which must be where it landed."""
        ex = self.ex
        for src, at, _ in ex.landed(self.region, self.chunk, rows):
            if at != at_slot[src] * ex.row_bytes + self.region * ex.world * ex.slot:
                raise RuntimeError(f"commopt moe: chunk {self.chunk}'s piece from rank {src} landed at byte {at}, its "
                                   f"run table has it at slot row {at_slot[src]}: the plan and the exchange disagree")
        rows_all = 2 * ex.world * ex.slot // ex.row_bytes  # both regions, as rows
        read_rows2(ex.compute, dst, runs, self.own, ex.buf.view(ex.me, 0, (rows_all, self.own.shape[1]), ex.dtype))


class CEExchange:
    """One pass of by_expert over `group`: its IN and OUT exchanges (see the module docstring).
    `post(region, c, outs, ins)` sends chunk c's piece ins[q] to each rank q (own piece copied on
    the compute stream) and returns the Arrival that fills outs[p] from each source p; `release`
    after a region's last arrival; `close` at the pass's end.  `passes` counts the passes made
    this way in the process (what the GPU tests check ran)."""

    passes = 0

    def __init__(self, group, device: torch.device, peak_rows: int, row_bytes: int, dtype: torch.dtype,
                 label: str) -> None:
        from torch_commopt.kernels.gpu import driver, symm

        self.symm, self.driver = symm, driver
        self.rt = rt = symm.runtime(group.group_name, device)
        self.me, self.world = rt.rank, rt.world
        self.row_bytes, self.dtype = row_bytes, dtype
        self.slot = slot_bytes(peak_rows, row_bytes)
        self.buf = rt.own_buffer(PURPOSE, 2 * self.world * self.slot)  # collective when it grows
        self.debug = rt.debug_waits()
        self.compute, self.side = torch.cuda.current_stream(device), rt.side
        self.sent = [[0] * self.world, [0] * self.world]  # rows written so far per region and peer
        self.got = [[0] * self.world, [0] * self.world]  # rows read so far per region and source
        self.taken: list[set[int]] = [set(), set()]
        self._events = 0
        self.watched = rt.begin_call("moe exchange", label=label)
        CEExchange.passes += 1

    def slot_rows(self) -> int:
        """The rows of a source's slot (what by_expert's placed run tables are laid out for)."""
        return self.slot // self.row_bytes

    def _free(self, region: int, peer: int) -> int:
        return self.symm.MOE_FREE + region * self.symm.MAX_WORLD + peer

    def _data(self, region: int, src: int) -> int:
        return self.symm.MOE_DATA + region * self.symm.MAX_WORLD + src

    def _at(self, region: int, src: int, rows: int) -> int:
        """Byte offset, in a rank's buffer, of row `rows` of source src's slot in `region`."""
        return (region * self.world + src) * self.slot + rows * self.row_bytes

    def post(self, region: int, chunk: int, outs: list[Tensor], ins: list[Tensor]) -> Arrival:
        rt, driver = self.rt, self.driver
        event = rt.pooled_event(PURPOSE, self._events)
        self._events += 1
        driver.record(event, self.compute)  # the pieces are ready on the compute stream
        driver.wait_event(self.side, event)
        for q in rt.peers:
            piece = ins[q]
            n = piece.shape[0]
            if self.sent[region][q] + n > self.slot // self.row_bytes:
                raise RuntimeError(f"commopt moe: {self.sent[region][q] + n} rows for rank {q} overflow its slot "
                                   f"of {self.slot // self.row_bytes} (the Routing's peak is wrong)")
            if q not in self.taken[region]:  # q has read everything this rank sent it before
                if q not in self.taken[1 - region]:  # this pass's first push to q: the other region too
                    self._drained(1 - region, q, chunk)
                rt.wait(self.side, self._free(region, q), 1, debug=self.debug, watched=self.watched,
                        what="free moe slot", src=q, chunk=chunk)
                driver.write_value32(self.side, rt.flag_address(self.me, self._free(region, q)), 0)
                self.taken[region].add(q)
            if n:
                piece.record_stream(self.side)
                driver.memcpy_async(self.side, self.buf.address(q, self._at(region, self.me, self.sent[region][q])),
                                    piece.data_ptr(), n * self.row_bytes)
            self.sent[region][q] += n
            rt.signal(self.side, q, self._data(region, self.me), chunk + 1)
        if outs is not None and ins[self.me].shape[0]:
            outs[self.me].copy_(ins[self.me])
        return Arrival(self, region, chunk, outs, ins[self.me])

    def _drained(self, region: int, q: int, chunk: int) -> None:
        """Side stream: hold until q has read what this rank sent into its `region` in the pass
        before, without taking that token.  Slots follow the pass's peak (slot_bytes), so a push
        into one region of a larger layout can land on the other region's bytes of the pass
        before, which q may still be reading under that region's token."""
        self.rt.wait(self.side, self._free(region, q), 1, debug=self.debug, watched=self.watched,
                     what="free moe slot", src=q, chunk=chunk)

    def landed(self, region: int, chunk: int, rows: list[int]) -> list[tuple[int, int, int]]:
        """Hold the compute stream until chunk c's pieces have landed; (source, byte offset in this
        rank's buffer, rows) of each, rows[src] the rows src sent in the chunk."""
        rt, out = self.rt, []
        for src in rt.sources:
            rt.wait(self.compute, self._data(region, src), chunk + 1, debug=self.debug, watched=self.watched,
                    what="moe piece", src=src, chunk=chunk)
            out.append((src, self._at(region, src, self.got[region][src]), rows[src]))
            self.got[region][src] += rows[src]
        return out

    def arrive(self, region: int, chunk: int, outs: list[Tensor]) -> None:
        """Hold the compute stream until chunk c's pieces have landed and copy them into outs."""
        for src, at, n in self.landed(region, chunk, [o.shape[0] for o in outs]):
            if n:
                _read(self.compute, outs[src], self.buf.view(self.me, at, tuple(outs[src].shape), self.dtype))

    def release(self, region: int) -> None:
        """After this rank's last read of `region` in the pass (stream-ordered on the compute
        stream): its data flags down, every source's token back."""
        rt, driver = self.rt, self.driver
        for src in rt.sources:
            driver.write_value32(self.compute, rt.flag_address(self.me, self._data(region, src)), 0)
        for src in rt.sources:
            rt.signal(self.compute, src, self._free(region, self.me), 1)

    def close(self) -> None:
        self.rt.end_call(self.watched)
        self.watched = None
        if self.debug:
            self.rt.check_status("moe exchange")


class NcclExchange:
    """The same calls over torch.distributed (by_expert._post): NCCL's all_to_all of views, or
    gloo's packed all_to_all_single."""

    def __init__(self, group, post) -> None:
        self.group, self._post = group, post

    def post(self, region: int, chunk: int, outs: list[Tensor], ins: list[Tensor]):
        return self._post(outs, ins, self.group)

    def release(self, region: int) -> None:
        pass

    def close(self) -> None:
        pass


def exchange_for(x: Tensor, group, peak_rows: int | None, label: str, post):
    """The pass's exchange: by the copy engine where `usable` and the call's peak is known (a
    Routing from exchange_counts), else over torch.distributed.  A symmetric allocation refused on
    any rank (past the byte cap) falls back to NCCL on every rank alike (SymmAllocError is raised
    on all of them at the same call), logged."""
    if peak_rows is not None and usable(x, group):
        from torch_commopt.kernels.gpu.symm import SymmAllocError

        try:
            return CEExchange(group, x.device, peak_rows, x.shape[1] * x.element_size(), x.dtype, label)
        except SymmAllocError as e:
            _once(f"alloc {group.group_name}", logging.WARNING, "commopt moe: %s; the exchange runs on NCCL", e)
    return NcclExchange(group, post)

