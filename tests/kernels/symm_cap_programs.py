"""symm.GroupRuntime's byte cap and buffer release on live gloo groups, with the CUDA parts
stubbed (each rank's allocation is a CPU tensor; the rendezvous hands back a stand-in handle)."""

from __future__ import annotations

import gc
import logging
import os
import weakref
from types import SimpleNamespace

import torch
import torch.distributed as dist

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import symm, symm_alloc, symm_cap
from torch_commopt.kernels.matmul import ops

MIB = 1 << 20


def _runtime(cap_mib: str) -> tuple[symm.GroupRuntime, list[str]]:
    """A runtime of the allocation path only, under the cap `cap_mib` (the variable's text); the
    sizes it allocates, each rendezvous (with the purpose's buffers held at that moment) and each
    release go to the returned event list."""
    os.environ[env.SYMM_CAP_MIB] = cap_mib
    symm_cap.reset()
    rt = object.__new__(symm.GroupRuntime)  # no CUDA streams, no flags
    rt.group_name, rt.device, rt.rank, rt.refused = dist.group.WORLD.group_name, None, dist.get_rank(), None
    rt.shared_device, rt.owned = False, {}
    events: list[str] = []

    def empty(numel, dtype):
        events.append(f"allocate {numel >> 20}")
        return torch.empty(numel, dtype=dtype)

    def rendezvous(local):
        held = [b.nbytes >> 20 for bufs in rt.owned.values() for b in bufs]
        events.append(f"rendezvous {local.numel() >> 20} holding {held}")
        return SimpleNamespace(buffer_ptrs=[local.data_ptr()] * dist.get_world_size())

    rt._empty, rt._rendezvous, rt._settle = empty, rendezvous, lambda local: local.zero_()
    return rt, events


class _Lines(logging.Handler):
    """The messages of a logger at `level` and above, kept in a list."""

    def __init__(self, name: str, level: int):
        super().__init__(level)
        self.lines: list[str] = []
        self.logger = logging.getLogger(name)
        self.logger.addHandler(self)
        self.logger.setLevel(min(self.logger.getEffectiveLevel(), level))

    def emit(self, record):
        self.lines.append(record.getMessage())


def _on_gpu(rt, purpose: str, mib: int) -> str:
    """ops._on_gpu around an own_buffer request: what an op would run."""
    buf = ops._on_gpu("ag_matmul", Schedule.parse("ce_push:1"), lambda: rt.own_buffer(purpose, mib * MIB))
    return "sequential" if buf is None else f"gpu {buf.nbytes >> 20} MiB"


def cap_on_one_rank(rank: int, world: int):
    """Cap 100 MiB on every rank; the last rank already holds 80 MiB on its device (another
    group's buffers).  Requests: 20 MiB (a 32 MiB class, 34 MiB with its signal pad: past the cap
    on the last rank only), then 10 MiB (16 MiB, 18 with the pad: fits everywhere), then 20 MiB
    again.  Returns what each request ran, the events, the bytes held (MiB), the refused
    class (MiB), the cap's log lines and the ops' warnings."""
    rt, events = _runtime("100")
    if rank == world - 1:
        symm_cap.hold(None, 80 * MIB)
    cap_log = _Lines("torch_commopt.kernels.gpu.symm_cap", logging.WARNING)
    ops_log = _Lines("torch_commopt.kernels.matmul.ops", logging.WARNING)
    ran = [_on_gpu(rt, "test", mib) for mib in (20, 10, 20)]
    return ran, events, symm_cap.held(None) // MIB, rt.refused // MIB, cap_log.lines, ops_log.lines


def supersede(rank: int, world: int, pin: bool):
    """Requests of one purpose growing 10 -> 12 -> 20 MiB (classes 16, 16, 32), then 40 MiB (64);
    pin: the 32 MiB buffer is used once inside a (stand-in) CUDA-graph capture first.  Returns
    the events, the buffers the purpose holds after each growth (MiB), whether the 16 MiB
    buffer's memory was freed, the bytes held (MiB) and the runtime's release log lines."""
    rt, events = _runtime("inf")
    released = _Lines("torch_commopt.kernels.gpu.symm", logging.INFO)
    first = rt.own_buffer("ring", 10 * MIB)
    first.view(rank, 0, (4, 4), torch.float32).fill_(rank)  # a cached view
    freed = weakref.ref(first.local)
    same = rt.own_buffer("ring", 12 * MIB) is first
    del first
    second = rt.own_buffer("ring", 20 * MIB)
    after_growth = [[b.nbytes >> 20 for b in rt.owned["ring"]]]
    gc.collect()
    first_freed = freed() is None
    if pin:
        capturing, symm_alloc.capturing = symm_alloc.capturing, lambda: True  # what own_buffer reads
        try:
            rt.own_buffer("ring", 20 * MIB)
        finally:
            symm_alloc.capturing = capturing
    rt.own_buffer("ring", 40 * MIB)
    after_growth.append([b.nbytes >> 20 for b in rt.owned["ring"]])
    held = symm_cap.held(None) // MIB
    del second
    return events, same, after_growth, first_freed, held, [line for line in released.lines if "released" in line]
