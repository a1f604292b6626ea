"""Symmetric-memory runtime: per-group buffers, flags, tokens, side stream, barrier.

One `GroupRuntime` per (process group, device), created on first use and kept:
- a flag array (int32, symmetric) that peers write with stream memory operations
  (cuStreamWriteValue32) or GPU atomics.  The protocol is *closed*: every value a call
  writes or waits for is a constant (0 or 1), and every flag is back to its resting value
  once the call's reads are done, so a call's work can be captured in a CUDA graph and
  replayed, and eager calls and graph replays can interleave on the same buffers:
  * DATA flags (per buffer half, source rank and chunk): the sender sets 1 when the chunk
    has landed; the receiver waits for 1 and sets 0 again after its last read;
  * FREE tokens (per half and peer, in the *sender's* flags): 1 while peer p has no
    unfinished reads of half h data exchanged with this rank.  Before its first write that
    p will read in a call (into p's buffer, or into its own buffer for p to pull) a rank
    waits for the token and takes it (sets 0); p gives it back (sets 1, a remote write)
    after its last read of that call.  Any write into its own buffer half waits for every
    peer's token on the same stream: slots follow the call's shape, so a call of another
    shape may cover bytes a peer still pulls, and a replayed graph takes no new half.
    Calls alternate the halves, so in steady state the wait is already satisfied and the
    ranks are not coupled call by call.
  Tile counters (fused schedules) count up within a call and are zeroed at its start,
  before a barrier (epochs, eager only) that lets peers write into this rank again.
- data buffers by size class (powers of two, >= 16 MiB), allocated with
  `torch.distributed._symmetric_memory.empty` and rendezvoused once (rendezvous blocks the
  host and is collective, so it must never happen per call, nor inside a graph capture).
- two high-priority side streams for copy-engine transfers (pushes to peers; local copies).

Every symmetric allocation (kernels/gpu/symm_alloc.py) is voted on before its rendezvous (through the c10d store, not a
collective): a rank whose allocation fails (out of memory) would otherwise leave its peers
blocked in the rendezvous until the process group times out.  When any rank fails, every rank
raises SymmAllocError at that call, before the call has moved anything, and the op runs NCCL
instead (kernels/matmul/ops.py, kernels/attention/comm.py, kernels/attention/schedules.py); a size class that failed
is refused at once afterwards, on every rank alike.

Memory is bounded per device (kernels/gpu/symm_cap.py): past a byte cap (TORCH_COMMOPT_SYMM_CAP_MIB,
default 1/8 of the device) a rank refuses the allocation inside that vote, so the whole group
runs NCCL for the call.  A purpose's own buffer that a larger one replaces is let go at once, on
every rank at the same call (`own_buffer`); the shared size classes stay, since the requests that
fit them keep using them.  Each buffer's cache of views is a bounded LRU, dropped with it.

No NVLink multicast is used anywhere: only unicast P2P loads/stores and copies.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import torch

from torch_commopt.core import env
from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.gpu import driver, shared_device, watchdog
from torch_commopt.kernels.gpu.call_graphs import capturing
from torch_commopt.kernels.gpu.symm_alloc import (  # noqa: F401  (SymmAllocError, size_class: the runtime's API)
    Allocations,
    SymmAllocError,
    SymmBuffer,
    off_thread,
    size_class,
)
from torch_commopt.kernels.gpu.watchdog import WaitTimeout

log = logging.getLogger("torch_commopt.kernels.gpu.symm")

MAX_WORLD = 64
MAX_CHUNKS = 256
HALVES = 2  # calls alternate the two halves of a buffer
FLAG_SLOTS = 1 << 17
# Flag regions (int32 indices into each rank's flag array).
BARRIER = 0  # [p]: epoch of rank p's latest barrier arrival (fused reductions, eager only)
FREE = 512  # [h * MAX_WORLD + p]: token, 1 while peer p has no unfinished reads of half h
# The attention ring's copy-engine transfers (kernels/attention/ce_ring.py), channel c (0: K/V, 1:
# spare) and half h: RING_FREE [c * HALVES + h]: token, 1 while the next rank has no unfinished
# reads of slot (c, h) this rank wrote into its ring buffer; RING_DATA [c * HALVES + h]: 1 once
# the previous rank has written this rank's slot (c, h).
RING_FREE = FREE + HALVES * MAX_WORLD
RING_DATA = RING_FREE + 2 * HALVES
DATA = 1024  # [h * PHASE_SLOTS + src * MAX_CHUNKS + c]: 1 once chunk c from src has landed
PHASE_SLOTS = MAX_WORLD * MAX_CHUNKS
DATA2 = DATA + HALVES * PHASE_SLOTS  # second phase (all-gather of matmul_ar)
COUNTERS = DATA2 + HALVES * PHASE_SLOTS  # [p * MAX_CHUNKS + c]: tiles finished (reset per call)
# This rank's own small device state lives in its flag array too (written locally only):
# a tensor from the caching allocator kept by the runtime would be flagged by Inductor's
# CUDA-graph trees when the runtime is created during their warm-up run, which allocates
# everything on the thread from the graph's private pool.
STATUS = COUNTERS + MAX_WORLD * MAX_CHUNKS  # [8]: debug-wait timeout record
FLAG_BASES = STATUS + 8  # int64 [MAX_WORLD]: every rank's flag array address (for Triton)
BUFFER_PTRS = FLAG_BASES + 2 * MAX_WORLD  # int64 [MAX_BUFFERS][MAX_WORLD]: data buffer addresses
MAX_BUFFERS = 32
# The attention all-to-alls' copy-engine transfers (kernels/attention/ce_a2a.py), region r (0: inputs
# sequence -> heads, 1: results heads -> sequence) and half h: A2A_FREE [(r * HALVES + h) *
# MAX_WORLD + p]: token, 1 while peer p has no unfinished reads of what this rank wrote into
# its slot (r, h); A2A_DATA [same index with p the source]: 1 once source p has written
# this rank's slot (r, h) -- in region 1, the number of results p has written (in order).
A2A_FREE = BUFFER_PTRS + MAX_BUFFERS * 2 * MAX_WORLD
A2A_DATA = A2A_FREE + 2 * HALVES * MAX_WORLD
# Expert parallelism's copy-engine exchange (kernels/moe/ce_exchange.py), region r (0: tokens to
# their experts, 1: outputs home): MOE_FREE [r * MAX_WORLD + p]: token, 1 while peer p has no
# unfinished reads of what this rank wrote into its region r; MOE_DATA [same index with p the
# source]: how many chunks of the call source p has written into this rank's region r.
MOE_FREE = A2A_DATA + 2 * HALVES * MAX_WORLD
MOE_DATA = MOE_FREE + 2 * MAX_WORLD
# The low-latency collectives' in-kernel barriers (kernels/gpu/lowlat.py): LL_BAR [(phase *
# LL_BLOCKS + block) * MAX_WORLD + p]: 1 once block `block` of rank p has reached barrier `phase`
# (0: before reading the peers' slots, 1: after), back to 0 once this rank's block has seen it.
LL_BLOCKS = 64
LL_BAR = MOE_DATA + 2 * MAX_WORLD
# int64 [2][MAX_WORLD]: every rank's low-latency slot address, then its reduced region's (two-shot)
LL_PTRS = LL_BAR + 2 * LL_BLOCKS * MAX_WORLD
assert LL_PTRS + 4 * MAX_WORLD <= FLAG_SLOTS and FLAG_BASES % 2 == 0 and LL_PTRS % 2 == 0
assert RING_DATA + 2 * HALVES <= DATA

DEBUG_ENV = env.DEBUG_WAITS  # bounded waits in every call of the process (core/env.py)
TIMEOUT_ENV = env.WAIT_TIMEOUT_S  # their wall-time bound


def debug_waits_from_env() -> bool:
    return env.debug_waits()


def debug_waits(schedule=None) -> bool:
    """Bounded waits for this call: the schedule's dbg=1 (Config.debug_waits) or the env
    (the env alone for callers without a schedule, e.g. the attention transports)."""
    return (schedule is not None and bool(schedule.param("dbg", 0))) or debug_waits_from_env()


def wait_bound() -> int:
    """Debug-mode spin bound in nanoseconds (TORCH_COMMOPT_WAIT_TIMEOUT_S, default 60 s)."""
    return int(env.wait_timeout_s() * 1e9)


Watched = watchdog.Call  # a call under the watchdog (GroupRuntime.begin_call): its record and its end mark


def _batches(stream, ops: list, last: int | None = None) -> None:
    """`ops` queued on `stream` in as few stream memory operations as the driver takes (each batch
    runs in order); last: the value of the final batch's cached last write (driver.batch)."""
    for start in range(0, len(ops), driver.MAX_BATCH):
        end = start + driver.MAX_BATCH
        driver.batch(stream, ops[start: end], last=last if end >= len(ops) else None)


class GroupRuntime(Allocations):
    """Everything the GPU schedules of one process group need, allocated once."""

    closed: str | None = None  # why the watchdog closed the runtime (kernels/gpu/watchdog.py)
    watch: Watched | None = None  # the call whose waits are being recorded for the watchdog

    def __init__(self, group_name: str, device: torch.device):
        group = resolve_group(group_name)
        self.group_name, self.device = group_name, device
        self.rank, self.world = group.rank(), group.size()
        if self.world > MAX_WORLD:
            raise ValueError(f"commopt: GPU schedules support up to {MAX_WORLD} ranks, group has {self.world}")
        # Peers in the order this rank sends to them, and in the order their data arrives.
        self.peers = [(self.rank + s) % self.world for s in range(1, self.world)]
        self.sources = [(self.rank - s) % self.world for s in range(1, self.world)]
        self.epoch = 0
        self.side = torch.cuda.Stream(device=device, priority=-1)
        # A second copy stream for local copies that must not queue behind the pushes
        # (the received partial into the output, while the side stream still ships).
        self.local = torch.cuda.Stream(device=device, priority=-1)
        # A second compute stream: ce_push:S:par=1 runs the peers' GEMMs there, beside the own
        # shard's GEMM on the caller's stream.
        self.compute2 = torch.cuda.Stream(device=device)
        self.shared_device = shared_device.enabled()
        if self.shared_device:
            log.warning("commopt: %s=1: symmetric buffers by CUDA IPC, ranks may share a GPU (for correctness runs only)",
                        shared_device.ENV)
        self.refused: int | None = None  # the smallest size class whose allocation failed somewhere
        flags = self._voted(lambda: self._capped(FLAG_SLOTS, torch.int32, "flag array"), "flag array")
        flags.zero_()
        flags[FREE: FREE + HALVES * MAX_WORLD].fill_(1)  # every token starts free
        flags[RING_FREE: RING_FREE + 2 * HALVES].fill_(1)
        flags[A2A_FREE: A2A_FREE + 2 * HALVES * MAX_WORLD].fill_(1)
        flags[MOE_FREE: MOE_FREE + 2 * MAX_WORLD].fill_(1)
        # A peer may write our flags as soon as rendezvous returns: the zeroing must be done.
        torch.cuda.synchronize(device)
        self.flags_handle = off_thread(lambda: self._rendezvous(flags), device)
        self.flags = flags
        self.flags_held = self._hold(flags)
        self.flag_bases = [int(p) for p in self.flags_handle.buffer_ptrs]
        self.flag_bases_dev = self._int64_table(FLAG_BASES, self.flag_bases)
        self.status = flags[STATUS: STATUS + 8]  # zeroed above
        self.buffers: list[SymmBuffer] = []
        self.owned: dict[str, list[SymmBuffer]] = {}  # own_buffer's, by purpose (the last is current)
        self._debug_kernel_loaded = False
        self._warned_capture_debug = False
        self._order_event: int | None = None  # after()'s event (driver handle)
        self._event_pools: dict[str, list[int]] = {}  # pooled_event's pools, per purpose (events(n): "")
        self._untaken: dict[int, int] = {}  # peer -> token index acquired in this call, not yet taken
        # The watchdog's view (kernels/gpu/watchdog.py): why the runtime was closed, the call whose
        # waits are being recorded, each slot's start batch, and what the watchdog thread reads the
        # flags with -- made here, not when a wait is stuck, when allocating could block.
        self._begin_batches: dict[int, object] = {}  # captured calls' start batches, per slot
        self._eager: dict[tuple[int, str], watchdog.EagerSlot | None] = {}  # (stream, lane) -> its slot
        self._peek_stream = torch.cuda.Stream(device=device, priority=-1)
        self._peek_host = driver.host_mapped(FLAG_SLOTS * 4)[0]
        self._context = driver.current_context()  # made current on the watchdog's thread
        log.info("commopt: symmetric runtime for group %s (rank %d of %d) on %s", group_name, self.rank, self.world, device)

    def debug_waits(self, schedule=None) -> bool:
        """Whether this call bounds its waits (see module-level debug_waits).  The first time,
        the wait kernel is compiled and loaded here, before this call launches anything that
        spins: loading a CUDA module waits for the device's running kernels, so a wait kernel
        first loaded while a persistent GEMM spins on the data behind that very wait would
        stall until the GEMM's own bound expired (the GPU test's 'fused store=ce' failure)."""
        if not debug_waits(schedule):
            return False
        if torch.cuda.is_current_stream_capturing():
            if not self._warned_capture_debug:
                self._warned_capture_debug = True
                log.warning("commopt: bounded (debug) waits are off inside a CUDA-graph capture: their status "
                            "check synchronizes the device")
            return False
        if not self._debug_kernel_loaded:
            from torch_commopt.kernels.gpu.waits import bounded_wait

            bounded_wait(self.flags, BARRIER, 0, self.status, code=0, src=0, chunk=0, bound=wait_bound())
            torch.cuda.synchronize(self.device)
            self._debug_kernel_loaded = True
        return True

    def next_epoch(self) -> int:
        """A new call: its number (and no deferred token take left from a call that raised)."""
        self._untaken.clear()
        self.epoch += 1
        return self.epoch

    def rewind(self, epoch: int) -> None:
        """Back to call number `epoch`, no deferred token take left: a call captured into a CUDA
        graph that failed (kernels/gpu/call_graphs.py) did not happen."""
        self._untaken.clear()
        self.epoch = epoch

    def has_buffer(self, nbytes: int) -> bool:
        """Whether a buffer of >= nbytes exists (a graph capture cannot create one)."""
        return any(b.nbytes >= nbytes for b in self.buffers)

    def buffer(self, nbytes: int) -> SymmBuffer:
        """The smallest cached buffer of >= nbytes, or a new one of the next size class.
        Every rank asks for the same sizes in the same order, so the collective rendezvous
        of a new class happens on all ranks together."""
        fitting = [b for b in self.buffers if b.nbytes >= nbytes]
        if fitting:
            return min(fitting, key=lambda b: b.nbytes)
        if len(self.buffers) >= MAX_BUFFERS:
            raise RuntimeError(f"commopt: more than {MAX_BUFFERS} symmetric buffer size classes for group {self.group_name}")
        local, handle = self._rendezvoused(nbytes, "shared")
        ptrs = self._int64_table(BUFFER_PTRS + len(self.buffers) * 2 * MAX_WORLD, [int(p) for p in handle.buffer_ptrs])
        buf = SymmBuffer(local, handle, self.rank, ptrs, held=self._hold(local))
        self.buffers.append(buf)
        return buf

    def _int64_table(self, index: int, values: list[int]) -> torch.Tensor:
        """int64 `values` stored at int32 index `index` of this rank's flag array (a view)."""
        table = self.flags[index: index + 2 * len(values)].view(torch.int64)
        table.copy_(torch.tensor(values, dtype=torch.int64))
        return table

    # ---- streams -----------------------------------------------------------------------
    def after(self, waiter, stream) -> None:
        """`waiter` (a stream) waits for the work queued on `stream` so far.  One event serves
        every call: it is recorded and waited on back to back, and a wait binds to the
        record before it."""
        if self._order_event is None:
            self._order_event = self._new_event()
        driver.stream_after(waiter, self._order_event, stream)

    def events(self, n: int) -> list[int]:
        """n events (driver handles) for one call's records that are waited on later, out of
        a pool kept for the runtime's lifetime (reused call after call: a wait binds to the
        record queued before it)."""
        return [self.pooled_event("", i) for i in range(n)]

    def pooled_event(self, purpose: str, index: int) -> int:
        """Event `index` (a driver handle) of one purpose's pool, created on first use and kept
        for the runtime's lifetime; the caller records each at most once per call and waits on it
        only within the call (a wait binds to the record queued before it)."""
        pool = self._event_pools.setdefault(purpose, [])
        while len(pool) <= index:
            pool.append(self._new_event())
        return pool[index]

    def _new_event(self) -> int:
        with torch.cuda.device(self.device):
            return driver.event_create()

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src queued on `stream`: one copy-engine copy when both are contiguous, one
        2-D copy-engine copy when both are equal contiguous runs at a pitch each (`pitched`:
        a rank's row blocks of a (B, S, K) activation), else Tensor.copy_ under the stream."""
        same = dst.dtype == src.dtype and dst.numel() == src.numel()
        if same and dst.is_contiguous() and src.is_contiguous():
            driver.memcpy_async(stream, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
            return
        if same and src.shape != dst.shape and src.is_contiguous():
            src = src.view(dst.shape)
        if same and src.shape == dst.shape:
            d, s = pitched(dst), pitched(src)
            if d is not None and s is not None and max(d[1], s[1]) <= MAX_PITCH:  # equal runs at a pitch: one 2-D copy
                driver.memcpy2d_async(stream, d[0], d[1], s[0], s[1], d[2], dst.shape[0])
                return
        with torch.cuda.stream(stream):
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))

    # ---- flags -------------------------------------------------------------------------
    def flag_address(self, rank: int, index: int) -> int:
        return self.flag_bases[rank] + 4 * index

    def signal(self, stream, dst: int, index: int, value: int) -> None:
        """After the stream's earlier work (fenced), write `value` into rank dst's flag (and
        take dst's token first if acquire left it to this signal)."""
        token = self._untaken.pop(dst, None)
        if token is None:
            driver.write_value32(stream, self.flag_address(dst, index), value)
            return
        driver.batch(stream, [("write", self.flag_address(self.rank, token), 0),
                              ("write", self.flag_address(dst, index), value)])

    def wait(self, stream, index: int, value: int, *, debug: bool, what: str, src: int, chunk: int,
             watched: Watched | None = None) -> None:
        """Hold `stream` until this rank's flag `index` >= value.  Debug mode spins in a
        one-block kernel with an iteration bound and records a timeout instead of hanging.
        watched: the call the wait belongs to (default: the runtime's current one, `watch`)."""
        self.expect(index, value, src=src, what=what, chunk=chunk, watched=watched)
        if not debug:
            driver.wait_value32(stream, self.flag_address(self.rank, index), value)
            return
        from torch_commopt.kernels.gpu.waits import bounded_wait

        with torch.cuda.stream(stream):
            bounded_wait(self.flags, index, value, self.status, code=WAIT_CODES[what], src=src, chunk=chunk,
                         bound=wait_bound())

    def expect(self, index: int, value: int, *, src: int, what: str, chunk: int = -1,
               watched: Watched | None = None, stride: int = 0, count: int = 1) -> None:
        """Tell the watchdog that the call waits for this rank's flag `index` >= value (a stream wait
        does it itself; a kernel's spins are told by its launcher); stride, count: the same wait
        on `count` flags `stride` apart (watchdog.Wait)."""
        w = watched or self.watch
        if w is not None:
            w.waits.append((index, value, src, what, chunk, what in TOKEN_WAITS, stride, count))  # a Wait's fields

    # ---- the watchdog ------------------------------------------------------------------------
    def begin_call(self, op: str, schedule=None, lane: str = "", label: str | None = None) -> Watched | None:
        """Start watching a call on the caller's current stream (None: not watched -- the watchdog
        is off, the call bounds its waits itself in debug mode, or no slot is left).  Raises
        WaitTimeout when a stuck call closed this runtime.  Every watched call ends with `end_call`
        on the same stream.  An eager call queues nothing here (its end mark says when it ended); a
        captured one its start batch (kernels/gpu/watchdog.py)."""
        if self.closed is not None:
            raise WaitTimeout(self.closed)
        # every eager call passes here: few calls, no object but its Call (a call's whole host
        # time is its cost on a host-bound GPU; benchmarks/results/watchdog_overhead_*)
        if not env.watch_calls() or (schedule is not None and schedule.param("dbg", 0)):
            return None
        handle = driver.current_handle(self.device)
        if not capturing():
            return self.begin_eager(op, schedule, handle, lane, label)
        dog = watchdog.get()
        slot = None if dog is None else dog.slot_for(self, handle, lane)
        if slot is None:
            return None
        call = watchdog.Call(op, label or schedule, self.group_name, self.rank, self.epoch + 1, threading.get_ident(),
                             self, handle, [], True, dog.slots.address(slot, watchdog.BUSY))
        batch = self._begin_batches.get(slot)
        if batch is None:
            marks = dog.slots
            batch = self._begin_batches[slot] = driver.batch_params(
                [("write", marks.address(slot, watchdog.TICKET), 0), ("write", marks.address(slot, watchdog.SEEN), 0),
                 ("write", marks.address(slot, watchdog.BUSY), 1)])
        batch[0].value = dog.ticket(call)  # the driver reads the batch during the call only
        driver.batch_array(handle, batch)
        return call

    def begin_eager(self, op: str, schedule, handle: int, lane: str = "", label: str | None = None) -> Watched | None:
        """begin_call for an eager call on stream `handle`, the caller having found the watchdog on
        (env.watch_calls()) and no capture under way (host_replay.call: its per-call host time)."""
        if self.closed is not None:
            raise WaitTimeout(self.closed)
        es = self._eager.get((handle, lane), False)
        if es is False:
            dog = watchdog.get()
            es = self._eager[(handle, lane)] = None if dog is None else dog.eager_slot(self, handle, lane)
        if es is None:
            return None
        call = watchdog.Call(op, label or schedule, self.group_name, self.rank, self.epoch + 1,
                             threading.get_ident(), self, handle, [], False, es.done)
        call.value = es.add(call)
        return call

    def end_call(self, watched: Watched | None) -> None:
        """The call's work is all queued (on its stream, or joined into it): its end mark, unless its
        last batch of flag writes took it along (done_reading)."""
        if watched is not None and not watched.ended:
            driver.write_value32(watched.stream, watched.end, watched.value)

    def check_open(self) -> None:
        """WaitTimeout when the watchdog closed this runtime (a call of the group got stuck)."""
        if self.closed is not None:
            raise WaitTimeout(self.closed)

    def close(self, message: str) -> None:
        """The watchdog found a call stuck: every later call of this runtime raises WaitTimeout."""
        self.closed = message

    def stream_idle(self, handle: int) -> bool:
        """Whether a stream has nothing left to run (the watchdog thread asks)."""
        driver.use_context(self._context)
        return driver.stream_done(handle)

    def read_flags(self, bound_s: float = 5.0, start: int = 0, count: int = FLAG_SLOTS):
        """This rank's flags [start, start + count) as the host sees them now (a copy-engine copy on
        a stream of the watchdog's, not behind the stuck ones), or None when the copy did not end
        within bound_s."""
        driver.use_context(self._context)
        driver.memcpy_dtoh_async(self._peek_stream, self._peek_host, self.flags.data_ptr() + 4 * start, 4 * count)
        deadline = time.monotonic() + bound_s
        while not driver.stream_done(self._peek_stream):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)
        return list((ctypes.c_int32 * count).from_address(self._peek_host))

    def release(self, index: int, value: int) -> None:
        """Write `value` into this rank's flag `index` (the watchdog releasing a stuck wait)."""
        driver.use_context(self._context)
        driver.write_value32(self._peek_stream, self.flag_address(self.rank, index), value)

    def reset_counters(self, stream, chunks: int) -> None:
        """Zero the tile counters of `chunks` pieces from every rank by stream memory operations
        (driver operations: a host replay queues them again, where a fill kernel would not be)."""
        _batches(stream, [("write", self.flag_address(self.rank, COUNTERS + src * MAX_CHUNKS + c), 0)
                          for src in range(self.world) for c in range(chunks)])

    def barrier(self, stream, epoch: int, *, debug: bool) -> None:
        """Stream-ordered barrier: every rank's `stream` has reached this point of call `epoch`."""
        for p in self.peers:
            self.signal(stream, p, BARRIER + self.rank, epoch)
        for p in self.peers:
            self.wait(stream, BARRIER + p, epoch, debug=debug, what="barrier", src=p, chunk=-1)

    def acquire(self, stream, peer: int, half: int, *, debug: bool, defer_take: bool = False) -> None:
        """Before this rank's first write of a call that `peer` will read (half `half`):
        wait for the token of (half, peer) and take it (set 0).  defer_take: the caller's
        next `signal` to `peer` takes it, in the same stream memory operation as the signal
        -- one operation fewer a peer and call, and each costs the GPU's front end
        microseconds in a replayed graph (docs/gpu-schedules.md#the-symmetric-memory-runtime).  Only for
        callers whose data signals go through `signal` (a kernel's own flag stores do not):
        a token must be taken before the signal that lets `peer` read, since `peer` gives it
        back after that read; taking it after the copies is safe for the same reason."""
        index = FREE + half * MAX_WORLD + peer
        self.wait(stream, index, 1, debug=debug, what="free buffer", src=peer, chunk=-1)
        if defer_take:
            self._untaken[peer] = index
        else:
            driver.write_value32(stream, self.flag_address(self.rank, index), 0)

    def done_reading(self, stream, half: int, chunks: int, *, phases: int = 1) -> None:
        """After this rank's last read of a call (stream-ordered): lower the DATA flags the
        call waited for (`chunks` per source and phase), then give every source its token
        back, as few stream memory operations as the driver takes (a batch runs in order).
        The flags are lowered first: a source writes them again only after it has taken the
        token back.  With env.tokens_on_side the tokens go from the side stream (below)."""
        if self._untaken:  # a deferred take no signal made: a schedule's bug, not the user's
            peers, self._untaken = sorted(self._untaken), {}
            raise RuntimeError(f"commopt: rank {self.rank} acquired the tokens of peers {peers} and never took them")
        ops = []
        for src in self.sources:
            for phase in range(phases):
                first = data_index(half, src, 0, phase)
                ops += [("write", self.flag_address(self.rank, first + c), 0) for c in range(chunks)]
        tokens = [("write", self.flag_address(src, FREE + half * MAX_WORLD + self.rank), 1) for src in self.sources]
        # env.tokens_on_side: the remote writes leave the caller's stream for the side stream,
        # ordered after the lowered flags (the side stream waits for the caller's stream as it
        # stands then); not under a capture, whose forked streams must be joined by its end
        side = self.side if env.tokens_on_side() and not capturing() else None
        ops += tokens if side is None else []
        w, last = self.watch, None
        if w is not None and not w.ended and w.stream == driver._handle(stream):
            # the call's last operation on its stream: its end mark rides along (one driver call less);
            # its value (an eager call's number) is set in the batch's cached parameters (driver.batch)
            ops.append(("write", w.end, 0))
            w.ended, last = True, w.value
        _batches(stream, ops, last)
        if side is not None:
            self.after(side, stream)
            _batches(side, tokens)

    def check_status(self, op: str) -> None:
        """Debug mode: synchronize and raise if any bounded wait of `op` timed out."""
        torch.cuda.synchronize(self.device)
        words = self.status[:6].tolist()
        if words[0]:
            self.status.zero_()
            raise WaitTimeout(self.status_message(words, op))

    def status_message(self, words: list[int], op: str) -> str:
        """What a bounded wait that gave up recorded in the status words (timed out, code, src,
        chunk, seen, expected), as the error names it."""
        _, code, src, chunk, seen, expected = words[:6]
        what = {v: k for k, v in WAIT_CODES.items()}.get(code, f"code {code}")
        return (f"commopt {op}: rank {self.rank} gave up waiting for {what} from rank {src}, chunk {chunk} "
                f"(flag {seen}, expected >= {expected}, epoch {self.epoch}) in group {self.group_name}: "
                "a peer stalled, crashed, or runs a different schedule")

    def read_status(self) -> list[int] | None:
        """The status words as the host sees them now (read_flags: the status lives in the flag
        array), or None when the copy did not end in time.  The watchdog's look at the calls
        that bound their own spins (watchdog.Watchdog.watch_status)."""
        return self.read_flags(start=STATUS, count=6)  # 24 bytes at each poll, not the 512 KB flag array


MAX_PITCH = 2**31 - 1  # cuMemcpy2DAsync's pitch limit (CU_DEVICE_ATTRIBUTE_MAX_PITCH on sm80/sm90)


def pitched(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(address, pitch, width) in bytes when `t` is t.shape[0] equal contiguous runs at a
    uniform pitch -- e.g. one rank's rows of every outer block of a (B, S, K) activation
    gathered along S -- so the copy engine moves it as one 2-D copy; None otherwise."""
    shape, stride = t.shape, t.stride()
    if len(shape) < 2 or shape[0] == 0:
        return None
    run = 1  # elements in one run: dims 1.. must be contiguous (a size-1 dim's stride is free)
    for size, st in zip(reversed(shape[1:]), reversed(stride[1:])):
        if size != 1 and st != run:
            return None
        run *= size
    if shape[0] > 1 and stride[0] < run:
        return None
    elt = t.element_size()
    return t.data_ptr(), max(stride[0], run) * elt, run * elt


def data_index(half: int, src: int, chunk: int, phase: int = 0) -> int:
    """Flag index of chunk `chunk` from `src` in buffer half `half` (phase 1: matmul_ar's
    all-gather of the reduced pieces)."""
    return (DATA2 if phase else DATA) + half * PHASE_SLOTS + src * MAX_CHUNKS + chunk


WAIT_CODES = {"barrier": 1, "chunk": 2, "partial": 3, "tiles": 4, "reduced chunk": 5, "free buffer": 6,
              "ring block": 7, "free ring slot": 8,
              "all-to-all piece": 9, "free all-to-all slot": 10, "moe piece": 11, "free moe slot": 12,
              "ll barrier": 13}
# taken (set 0) once passed
TOKEN_WAITS = frozenset({"free buffer", "free ring slot", "free all-to-all slot", "free moe slot", "ll barrier"})

_RUNTIMES: dict[tuple[str, int], GroupRuntime] = {}
# Runtimes whose flag array the group's ranks did not all allocate (e.g. past the cap), and why:
# refused at once afterwards, on every rank alike, as a failed size class is (no vote a call).
_REFUSED: dict[tuple[str, int], str] = {}


def capture_refusal(group_name: str, device: torch.device, op: str, schedule, nbytes: int) -> str | None:
    """Why a call cannot run `schedule` inside the CUDA-graph capture now under way (None:
    it can).  Creating the runtime or a buffer rendezvouses (host-blocking, collective) and
    synchronizes, which a capture forbids; the fused reductions pass a barrier that counts
    epochs, values a replay would repeat."""
    if schedule.in_capture(op) != schedule:
        return f"CUDA-graph capture (runs {schedule.in_capture(op)} there)"
    rt = existing(group_name, device)
    if rt is None or not rt.has_buffer(nbytes):
        return (f"CUDA-graph capture before a {max(nbytes, 1) >> 20} MiB symmetric buffer exists "
                "(run the call once outside the graph first)")
    return None


def _key(group_name: str, device: torch.device) -> tuple[str, int]:
    return group_name, device.index if device.index is not None else torch.cuda.current_device()


def existing(group_name: str, device: torch.device) -> GroupRuntime | None:
    """The group's runtime on `device` if one was created (creating one synchronizes)."""
    return _RUNTIMES.get(_key(group_name, device))


def runtime(group_name: str, device: torch.device) -> GroupRuntime:
    """The group's runtime on `device`, created at the first call (collective: SymmAllocError on
    every rank of the group when its flag array was not allocated on every rank)."""
    key = _key(group_name, device)
    rt = _RUNTIMES.get(key)
    if rt is None:
        if key in _REFUSED:
            raise SymmAllocError(_REFUSED[key])
        try:
            rt = _RUNTIMES[key] = GroupRuntime(group_name, torch.device("cuda", key[1]))
        except SymmAllocError as e:
            _REFUSED[key] = f"{e} (refused since)"
            raise
        watchdog.prepare()  # started here, outside any capture (a first watched call may be captured)
    return rt
