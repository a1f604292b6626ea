"""Per-rank programs for the symmetric-memory cap and buffer release on GPUs (kernels/gpu/symm_cap.py,
symm.GroupRuntime.own_buffer): numerics against the float64 truth as in kernel_cases."""

from __future__ import annotations

import gc
import logging
import os
import weakref

import torch
import torch.distributed as dist
from kernel_cases import _group_name, refusal_sequence

from torch_commopt.core import env
from torch_commopt.kernels.gpu import symm, symm_cap

MIB = 1 << 20


class _Lines(logging.Handler):
    def __init__(self, name: str):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.name_ = name
        logging.getLogger(name).addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def close(self):
        logging.getLogger(self.name_).removeHandler(self)
        super().close()


def run_cap_fallback(rank: int, world: int):
    """The last rank's cap (40 MiB) holds the flag array and a 16 MiB size class but not a 64 MiB
    one; the others have none.  Calls: a small all-gather (16 MiB class: a GPU schedule), a
    reduce-scatter needing 64 MiB (refused by the last rank's cap: NCCL on every rank), an
    all-gather needing 128 MiB (refused at once), a small reduce-scatter (the 16 MiB class
    again).  Returns [(name, error, reference error)], the ops' warnings, the cap's warnings,
    the MiB held and the MiB the flag array and the 16 MiB class take together."""
    os.environ[env.SYMM_CAP_MIB] = "40" if rank == world - 1 else "inf"
    ops_log, cap_log = _Lines("torch_commopt.kernels.matmul.ops"), _Lines("torch_commopt.kernels.gpu.symm_cap")
    try:
        results = refusal_sequence(rank, world)
    finally:
        ops_log.close()
        cap_log.close()
    device = torch.device("cuda", torch.cuda.current_device())
    shared = symm.existing(_group_name(), device).shared_device
    expected = symm_cap.footprint(symm.FLAG_SLOTS * 4, shared_device=shared) + symm_cap.footprint(
        16 * MIB, shared_device=shared)
    return results, ops_log.lines, cap_log.lines, symm_cap.held(device) // MIB, expected // MIB


def _exchange(buf, rank: int, world: int, value: float) -> bool:
    """Every rank writes `value + rank` into the next rank's copy of `buf` (peer stores), then
    reads its own: whether it holds what the previous rank wrote."""
    n = 1 << 20
    torch.cuda.synchronize()
    dist.barrier()
    buf.view((rank + 1) % world, 0, (n,), torch.float32).fill_(value + rank)
    torch.cuda.synchronize()
    dist.barrier()
    got = buf.view(rank, 0, (n,), torch.float32)
    return bool((got == value + (rank - 1) % world).all().item())


def run_supersede(rank: int, world: int):
    """A purpose's buffer grows 20 -> 40 MiB (classes 32 and 64): the 32 MiB one is released on
    every rank (the cap's count, its memory), and both carry peer writes.  Returns (first
    exchange ok, second ok, the first buffer's tensor freed, the bytes held more after the growth,
    the second's footprint less the first's, the device's free MiB lost over the growth or None
    in the shared-device mode, where the caching allocator keeps IPC-shared blocks)."""
    device = torch.device("cuda", torch.cuda.current_device())
    rt = symm.runtime(_group_name(), device)
    first = rt.own_buffer("cap test", 20 * MIB)
    ok_first = _exchange(first, rank, world, 10.0)
    freed, footprint = weakref.ref(first.local), first.held
    held_before = symm_cap.held(device)
    del first
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()
    free_before = torch.cuda.mem_get_info(device)[0]
    second = rt.own_buffer("cap test", 40 * MIB)
    gc.collect()
    torch.cuda.synchronize()
    dist.barrier()  # every rank has let its copy go (and its mappings of the peers')
    torch.cuda.empty_cache()
    lost = (free_before - torch.cuda.mem_get_info(device)[0]) // MIB
    ok_second = _exchange(second, rank, world, 20.0)
    return (ok_first, ok_second, freed() is None, symm_cap.held(device) - held_before, second.held - footprint,
            None if rt.shared_device else lost)
