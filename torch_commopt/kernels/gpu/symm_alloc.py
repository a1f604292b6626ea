"""Symmetric allocations of the runtime (kernels/gpu/symm.py): the buffers, their views, and the
vote and rendezvous that make them.

Every symmetric allocation is voted on before its rendezvous (through the c10d store, not a
collective): a rank whose allocation fails (out of memory) would otherwise leave its peers
blocked in the rendezvous until the process group times out.  When any rank fails, every rank
raises SymmAllocError at that call, before the call has moved anything, and the op runs NCCL
instead; a size class that failed is refused at once afterwards, on every rank alike.  Past the
byte cap (kernels/gpu/symm_cap.py) a rank refuses inside that vote.

`Allocations` is GroupRuntime's part that makes them (a base class of it: it reads the
runtime's group, rank, device, buffers and refusals); symm.py keeps the shared size classes'
`buffer`, whose addresses go into the flag array's tables.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed._symmetric_memory as symm_mem

from torch_commopt.core import env
from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.gpu import shared_device, symm_cap
from torch_commopt.kernels.gpu.call_graphs import capturing

log = logging.getLogger("torch_commopt.kernels.gpu.symm")  # the runtime's logger: one name for its messages

MIN_BUFFER_BYTES = 1 << 24
# Views cached per buffer (least recently used dropped first): a steady loop's calls take a few
# hundred per shape and buffer half (W slots, their pieces, both phases), so a program's
# working set stays cached, while new shapes (dynamic rows) no longer grow the cache forever.
MAX_VIEWS = 4096


def size_class(nbytes: int) -> int:
    """The bytes a symmetric buffer of at least nbytes is allocated with: a power of two, at
    least MIN_BUFFER_BYTES.  `GroupRuntime.buffer` serves a request from the smallest cached
    buffer that holds it, so regions whose requests share a class share one buffer (what the
    whole-graph plan counts, reshard/plan.py)."""
    return max(MIN_BUFFER_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
_ALLOCATIONS: Counter[tuple[str, str]] = Counter()  # (group, purpose) -> allocations voted on so far


@dataclass
class SymmBuffer:
    """One rendezvoused symmetric allocation; views of any rank's copy by byte offset."""

    local: torch.Tensor  # uint8, this rank's memory
    handle: object
    rank: int
    ptrs_dev: torch.Tensor | None  # int64 base addresses of every rank's copy (for Triton; None: not needed)
    views: OrderedDict = field(default_factory=OrderedDict)  # LRU, at most MAX_VIEWS
    bases: list[int] | None = None  # every rank's copy's address here (address(), filled at first use)
    held: int = 0  # the footprint symm_cap counts for it (0: not counted, or released)
    pinned: bool = False  # used inside a CUDA-graph capture: kept for the process's lifetime

    @property
    def nbytes(self) -> int:
        return self.local.numel()

    def host_bases(self) -> list[int]:
        """Every rank's copy's address here, by rank (built at the first use, then kept)."""
        if self.bases is None:
            self.bases = [int(p) for p in self.handle.buffer_ptrs]
            self.bases[self.rank] = self.local.data_ptr()
        return self.bases

    def address(self, rank: int, offset_bytes: int) -> int:
        """Device address of byte `offset_bytes` of rank `rank`'s copy (mapped here)."""
        return self.host_bases()[rank] + offset_bytes

    def view(self, rank: int, offset_bytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor on this device aliasing rank `rank`'s buffer (peer memory through P2P).
        Views are cached (building a peer tensor costs host time on every call), the least
        recently used dropped past MAX_VIEWS."""
        key = (rank, offset_bytes, tuple(shape), dtype)
        views = self.views
        cached = views.get(key)
        if cached is None:
            cached = views[key] = self._make_view(rank, offset_bytes, key[2], dtype)
            if len(views) > MAX_VIEWS:
                views.popitem(last=False)
        else:
            views.move_to_end(key)
        return cached

    def _make_view(self, rank: int, offset_bytes: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        elt = dtype.itemsize
        if offset_bytes % elt or offset_bytes + numel * elt > self.nbytes:
            raise ValueError(f"commopt: symmetric view [{offset_bytes}, +{numel * elt}) outside a {self.nbytes}-byte buffer")
        if rank == self.rank:
            return self.local[offset_bytes: offset_bytes + numel * elt].view(dtype).view(shape)
        return self.handle.get_buffer(rank, shape, dtype, offset_bytes // elt)


class SymmAllocError(RuntimeError):
    """A symmetric allocation failed on at least one rank of the group.  Every rank of the
    group raises it at the same call, before the call has moved anything (see the module
    docstring), so the caller can run another schedule instead."""


class Allocations:
    """GroupRuntime's allocations (see the module docstring): purpose-owned buffers and the vote,
    cap and rendezvous behind every symmetric allocation."""

    rank: int
    group_name: str
    device: torch.device
    shared_device: bool
    refused: int | None
    owned: dict

    def has_own_buffer(self, purpose: str, nbytes: int) -> bool:
        return bool(self.owned.get(purpose)) and self.owned[purpose][-1].nbytes >= nbytes

    def own_buffer(self, purpose: str, nbytes: int) -> SymmBuffer:
        """A symmetric buffer of >= nbytes that only `purpose` uses (not one of `buffer`'s
        shared size classes: its slots are guarded by tokens of its own), the last one made.
        A larger request allocates a new one (collective, like `buffer`) and lets the old one
        go (`_supersede`).  One used inside a CUDA-graph capture is kept instead (pinned):
        the graph replays its addresses."""
        kept = self.owned.setdefault(purpose, [])
        if kept and kept[-1].nbytes >= nbytes:
            if not kept[-1].pinned and capturing():
                kept[-1].pinned = True
            return kept[-1]
        local, handle = self._rendezvoused(nbytes, purpose)
        new = SymmBuffer(local, handle, self.rank, None, held=self._hold(local))
        self._supersede(purpose, kept, new)
        return new

    def _supersede(self, purpose: str, kept: list[SymmBuffer], new: SymmBuffer) -> None:
        """`new` becomes the purpose's buffer; the ones before it that no capture pinned are let
        go: dropped from the runtime (views and all) and from the cap's count.  Safe here, on
        every rank at the same call: each rank asks for the same sizes in the same order, so
        every rank supersedes the same buffer at this call and none picks it again; and new's
        rendezvous returned only once every rank had settled it (`_settle`: its device
        synchronized), so no work queued before this call touches the old buffer any more.
        Work after it touches it only through an object of a call under way that still holds it
        (a ring shift of channel 0 when channel 1 grew the buffer), on every rank alike, and that
        reference keeps its memory.  The memory goes with its last reference -- freeing is local
        to each process with torch's CUDA symmetric memory (cuMemUnmap, cuMemRelease), not a
        collective, and a peer's mapping keeps the pages until that peer lets go too."""
        gone = [old for old in kept if not old.pinned]
        kept[:] = [old for old in kept if old.pinned] + [new]
        if gone:
            self._release(purpose, gone)
            # the last references go on the helper thread, as the allocation came: torch's release
            # synchronizes the device and frees the rendezvous's small tables, which must not be
            # the calling thread's (a CUDA-graph tree's warm-up routes it to a private pool)
            off_thread(gone.clear, self.device)

    def _release(self, purpose: str, gone: list[SymmBuffer]) -> None:
        """Drop the views of buffers let go and stop counting them against the cap (logged)."""
        for buf in gone:
            buf.views.clear()
            symm_cap.release(self.device, buf.held)
            buf.held = 0
            log.info("commopt: released the symmetric %s buffer of %d MiB of group %s (%d MiB held on %s now)",
                     purpose, buf.nbytes >> 20, self.group_name, symm_cap.held(self.device) >> 20, self.device)

    def _capped(self, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        """_empty(numel, dtype) unless it would take this device past the cap (symm_cap): then
        SymmCapExceeded, which the allocation vote turns into SymmAllocError on every rank."""
        asked = symm_cap.footprint(numel * dtype.itemsize, shared_device=self.shared_device)
        symm_cap.check(self.device, asked, what, f"rank {self.rank} of group {self.group_name}")
        return self._empty(numel, dtype)

    def _hold(self, local: torch.Tensor) -> int:
        """Count an agreed allocation against the cap; its footprint."""
        held = symm_cap.footprint(local.numel() * local.element_size(), shared_device=self.shared_device)
        symm_cap.hold(self.device, held)
        return held

    def _rendezvoused(self, nbytes: int, purpose: str):
        """(local uint8 tensor, handle) of a new symmetric allocation of nbytes' size class;
        collective."""
        size = size_class(nbytes)
        what = f"{purpose} buffer of {size >> 20} MiB"
        if self.refused is not None and size >= self.refused:  # known on every rank: no vote
            raise SymmAllocError(f"commopt: no symmetric {what} for group {self.group_name}: one of "
                                 f"{self.refused >> 20} MiB already failed")
        try:
            local = self._voted(lambda: self._capped(size, torch.uint8, what), what)
        except SymmAllocError:
            self.refused = size if self.refused is None else min(self.refused, size)
            raise
        self._settle(local)
        handle = off_thread(lambda: self._rendezvous(local), self.device)
        log.info("commopt: symmetric %s buffer of %d MiB for group %s", purpose, size >> 20, self.group_name)
        mapped = int(handle.buffer_ptrs[self.rank])
        if mapped != local.data_ptr() and not self.shared_device:  # a diagnostic: can they differ? (open)
            log.info("commopt: the %s buffer's own address in the rendezvous handle (%#x) is not its tensor's "
                     "(%#x): offset %d (the schedules address their own slots through the tensor)", what, mapped,
                     local.data_ptr(), mapped - local.data_ptr())
        return local, handle

    def _settle(self, local: torch.Tensor) -> None:
        """A new allocation written once by this rank (zeros, on its current stream) and the device
        synchronized, before the rendezvous lets a peer write it -- the flag array's rule too.
        Without it, the first call on a Ulysses all-to-all buffer grown while the GPU was busy read
        wrong results (as if half the output were missing), while the same growth on an idle GPU
        never did, nor the first buffer (allocated after the runtime's synchronize); with it the
        same worker was exact every time (docs/gpu-schedules.md#the-symmetric-memory-runtime).
        Suspected, not shown: the driver's own first initialization of the new pages, ordered
        before this device's later work but not before a peer's writes over NVLink.  Once per
        buffer: ~0.4 ms for 1 GiB."""
        with torch.cuda.device(self.device):
            local.zero_()
            torch.cuda.synchronize(self.device)

    def _voted(self, allocate, what: str) -> torch.Tensor:
        """allocate() (off-thread), then a vote of the group's ranks: the tensor if every rank
        allocated, else SymmAllocError on every rank (the local tensor, if any, is dropped)."""
        from torch_commopt.core import consistency

        try:
            local, mine = off_thread(allocate, self.device), "ok"
        except Exception as e:  # out of memory, mostly; any failure must reach the vote
            local, mine = None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        # Allocations run in the same order on every rank; the identity is the buffer's purpose and
        # its ordinal in this process, so a rank that votes late reads the outcome the others took.
        _ALLOCATIONS[self.group_name, what] += 1
        ordinal = _ALLOCATIONS[self.group_name, what]
        decision = consistency.Decision("allocation", self.group_name, consistency.digest([what, ordinal]),
                                        f"symmetric {what} #{ordinal}")
        # The others reach the same allocation at the same call, give or take a compile; past the
        # bound every rank runs NCCL for that call: a dead peer is named, a slow one costs speed.
        outcome = consistency.agree(decision, mine, env.agree_timeout_s())
        if outcome.agreed and outcome.value == "ok" and local is not None:
            return local
        del local
        raise SymmAllocError(f"commopt: the symmetric {what} for group {self.group_name} was not allocated on "
                             f"every rank ({mine if outcome.agreed else outcome.detail})")

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.shared_device:  # a plain allocation, mapped by CUDA IPC at rendezvous
            return torch.empty(numel, dtype=dtype, device=self.device)
        return symm_mem.empty(numel, dtype=dtype, device=self.device)

    def _rendezvous(self, local: torch.Tensor):
        if self.shared_device:
            return shared_device.rendezvous(local, resolve_group(self.group_name))
        return symm_mem.rendezvous(local, self.group_name)


def off_thread(fn, device: torch.device | None = None):
    """fn() on a helper thread with `device` current there (the caller waits).  Symmetric allocations and
    their rendezvous outlive the call that makes them (most, the process), and rendezvous allocates
    small device tables through the caching allocator: Inductor's CUDA-graph trees route every
    allocation of the *calling thread* to the graph's private pool during their warm-up
    run, and then refuse a pool holding tensors that are not outputs."""
    result: dict = {}

    def run():
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                result["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    worker = threading.Thread(target=run, name="commopt-symm-setup")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
