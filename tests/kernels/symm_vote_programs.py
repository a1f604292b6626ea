"""symm.GroupRuntime's allocation vote on live gloo groups, with the CUDA parts stubbed: each
rank's allocation is a CPU tensor, or an out-of-memory error on the ranks told to fail."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from torch_commopt.kernels.gpu import symm


def _runtime(fail_on: dict[int, set[int]]) -> tuple[symm.GroupRuntime, list[int], list[str]]:
    """A runtime whose allocation of n bytes fails on the ranks in fail_on[n] (the sizes it
    tried are recorded in the returned list); rendezvous returns a stand-in handle; the order
    of each allocation's local settling and rendezvous goes to the events list."""
    rt = object.__new__(symm.GroupRuntime)  # the allocation path only: no CUDA streams, no flags
    rt.group_name, rt.device, rt.rank, rt.refused = dist.group.WORLD.group_name, None, dist.get_rank(), None
    rt.shared_device = False
    tried: list[int] = []
    events: list[str] = []

    def empty(numel, dtype):
        tried.append(numel)
        if rt.rank in fail_on.get(numel, ()):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {numel >> 20} MiB (rank {rt.rank})")
        return torch.empty(numel, dtype=dtype)

    def rendezvous(local):
        events.append(f"rendezvous {local.numel() >> 20}")
        return SimpleNamespace(name="handle", buffer_ptrs=[local.data_ptr()] * dist.get_world_size())

    def settle(local):  # the CUDA part (zero + synchronize) stubbed; the zeroing kept
        local.zero_()
        events.append(f"settle {local.numel() >> 20}")

    rt._empty, rt._rendezvous, rt._settle = empty, rendezvous, settle
    return rt, tried, events


def _attempt(rt, nbytes: int) -> str:
    try:
        local, handle = rt._rendezvoused(nbytes, "shared")
    except symm.SymmAllocError as e:
        return f"refused: {e}"
    return f"ok {local.numel() >> 20} MiB, {handle.name}"


def vote_sequence(rank: int, world: int):
    """The same requests on every rank: 32 MiB (fine), 64 MiB (rank world-1 out of memory),
    128 MiB (refused at once: a smaller class failed), 16 MiB (fine).  Returns each request's
    outcome, the sizes this rank tried to allocate, the refused class and the settle /
    rendezvous order."""
    mib = 1 << 20
    rt, tried, events = _runtime({64 * mib: {world - 1}})
    outcomes = [_attempt(rt, n * mib) for n in (32, 64, 128, 16)]
    return outcomes, [n >> 20 for n in tried], rt.refused >> 20, events
