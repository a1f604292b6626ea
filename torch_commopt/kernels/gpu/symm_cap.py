"""The byte cap on the symmetric memory one process holds per device, and the ledger it checks.

Every symmetric allocation of the runtime (kernels/gpu/symm.py: each group's flag array, its
shared size classes and the buffers a purpose owns) is counted here, per device and over all
process groups, by its footprint: the bytes asked, plus the signal pad torch's symmetric memory
puts in the same block, rounded up to the allocation granularity.  An allocation that would take
the device past the cap is refused *inside* the allocation vote (symm_alloc.Allocations._voted), so
the group's other ranks refuse with it and every rank runs NCCL for that call; the refusing rank
logs the cap, the bytes held and the bytes asked once.

The default cap, 1/8 of the device's memory, holds a group's buffers (its largest size class
twice over at most, plus one buffer per purpose: a few GiB for the largest activations, e.g. 1 GiB
for an all-gather of 32768 tokens 8192 wide in bf16) with room for a second group, and leaves 7/8
to the program's weights, activations and caching allocator, from 24 GB cards to 141 GB ones
(docs/configuration.md#environment-variables).  TORCH_COMMOPT_SYMM_CAP_MIB (core/env.py) sets it
per process.
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from torch_commopt.core import env

log = logging.getLogger("torch_commopt.kernels.gpu.symm_cap")

DEFAULT_FRACTION = 8  # the default cap: 1/DEFAULT_FRACTION of the device's memory
# cuMemCreate's recommended granularity on sm80/sm90: every symmetric block is a multiple of it
# (so is every caching-allocator block of 2 MiB or more, the shared-device mode's buffers).
GRANULARITY = 2 << 20
MIB = 1 << 20

_HELD: dict[str, int] = {}  # device -> bytes this process holds there (footprints)
_LOCK = threading.Lock()  # allocations run on a helper thread (symm_alloc.off_thread)
_told: set[tuple[str, str]] = set()


class SymmCapExceeded(RuntimeError):
    """A symmetric allocation this rank refused: it would take the device past the cap.  Raised
    inside the allocation vote, so every rank of the group raises symm.SymmAllocError."""


def device_key(device) -> str:
    """The ledger's key of a device: "cuda:<index>" (the current device for a bare "cuda")."""
    if isinstance(device, torch.device) and device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def footprint(nbytes: int, *, shared_device: bool) -> int:
    """The device bytes a symmetric allocation of `nbytes` takes: torch's symmetric memory puts
    its signal pad in the same block (none in the shared-device mode: a caching-allocator tensor),
    and blocks come in whole granules."""
    pad = 0 if shared_device else symm_mem_signal_pad()
    return -(-(nbytes + pad) // GRANULARITY) * GRANULARITY


def symm_mem_signal_pad() -> int:
    """The signal pad torch's symmetric memory allocates with each block (bytes)."""
    import torch.distributed._symmetric_memory as symm_mem

    get = getattr(symm_mem, "get_signal_pad_size", None)
    return int(get()) if get is not None else 0


def cap_bytes(device) -> int | None:
    """The cap on `device` (None: no cap): TORCH_COMMOPT_SYMM_CAP_MIB where set, else 1/8 of a CUDA
    device's memory (no cap on any other device: the CPU tests' stand-ins)."""
    mib = env.symm_cap_mib()
    if mib is not None:
        return None if math.isinf(mib) else int(mib * MIB)
    if not (isinstance(device, torch.device) and device.type == "cuda"):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).total_memory // DEFAULT_FRACTION


def held(device) -> int:
    """The bytes of symmetric memory this process holds on `device` (footprints, every group)."""
    return _HELD.get(device_key(device), 0)


def hold(device, nbytes: int) -> None:
    """Count an allocation that every rank of its group agreed on."""
    with _LOCK:
        key = device_key(device)
        _HELD[key] = _HELD.get(key, 0) + nbytes


def release(device, nbytes: int) -> None:
    """Stop counting an allocation the runtime has let go of."""
    with _LOCK:
        key = device_key(device)
        _HELD[key] = max(0, _HELD.get(key, 0) - nbytes)


def check(device, asked: int, what: str, where: str) -> None:
    """Raise SymmCapExceeded (after one log line per allocation) when `asked` more bytes would take
    `device` past the cap.  where: "rank R of group G", for the message."""
    cap = cap_bytes(device)
    now = held(device)
    if cap is None or now + asked <= cap:
        return
    message = (f"{where}: {now // MIB} MiB held + {asked // MIB} MiB asked > cap {cap // MIB} MiB on "
               f"{device_key(device)} ({env.SYMM_CAP_MIB})")
    if (where, what) not in _told:
        _told.add((where, what))
        log.warning("commopt: symmetric memory cap: the %s on %s would hold %d MiB there, past the cap of %d MiB "
                    "(%d MiB held, %d MiB asked); every rank of the group runs NCCL for the calls that need it "
                    "(%s sets the cap)", what, where, (now + asked) // MIB, cap // MIB, now // MIB, asked // MIB,
                    env.SYMM_CAP_MIB)
    raise SymmCapExceeded(message)


def reset() -> None:
    """Forget the ledger (tests; a process whose runtimes are all gone)."""
    with _LOCK:
        _HELD.clear()
        _told.clear()
