"""Several ranks on one GPU, for correctness runs only (TORCH_COMMOPT_SHARED_DEVICE=1).

torch's CUDA symmetric memory refuses ranks whose allocations share a device, and NCCL
refuses two ranks on one GPU.  With this switch the runtime's symmetric buffers are plain
caching-allocator tensors mapped into the other ranks' processes by CUDA IPC (handles
exchanged over the process group, which must then be gloo), so every GPU schedule's
flag protocol, copies and kernels run across real processes on a one-GPU machine.

What it checks: ordering, flags at rest, buffer reuse, numerics.  What it cannot: timing
(the processes' contexts time-slice one GPU), NVLink's memory ordering, NCCL.  Never on in
production: `enabled()` is read once per runtime, which logs a warning when it is on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torch_commopt.core import env

ENV = env.SHARED_DEVICE


def enabled() -> bool:
    """TORCH_COMMOPT_SHARED_DEVICE, read now (core/env.py)."""
    return env.shared_device()


def on_cuda(backend: str) -> bool:
    """Whether a process group whose backend is named `backend` works on the GPUs: NCCL (or
    a "cpu:gloo,cuda:nccl" group), or gloo with the ranks sharing one GPU in this mode."""
    return "nccl" in str(backend) or (enabled() and torch.cuda.is_available())


class IpcHandle:
    """What the runtime uses of a symmetric-memory handle: every rank's base address here,
    and views of any rank's copy."""

    def __init__(self, mapped: list[torch.Tensor]):
        self.mapped = mapped  # rank r's uint8/int32 allocation, mapped into this process
        self.buffer_ptrs = [t.data_ptr() for t in mapped]

    def get_buffer(self, rank: int, shape, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self.mapped[rank].view(dtype)
        if storage_offset + numel > flat.numel():
            raise ValueError(f"commopt: shared-device view [{storage_offset}, +{numel}) outside {flat.numel()} elements")
        return flat[storage_offset: storage_offset + numel].view(tuple(shape))


def rendezvous(local: torch.Tensor, group: dist.ProcessGroup) -> IpcHandle:
    """Collective: every rank's `local` mapped into every process (CUDA IPC; a CPU tensor goes
    through shared memory, which the CPU tests use)."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions with ForkingPickler)

    if local.is_cuda:
        torch.cuda.synchronize(local.device)
    else:
        local.share_memory_()
    shared: list = [None] * group.size()
    # ForkingPickler shares the memory (an IPC handle; a shared-memory file for a CPU tensor)
    # where plain pickle would copy the data.
    dist.all_gather_object(shared, bytes(ForkingPickler.dumps(local)), group=group)
    rank = group.rank()
    mapped = [local if r == rank else pickle.loads(blob) for r, blob in enumerate(shared)]
    for r, t in enumerate(mapped):
        if t.device != local.device or t.numel() != local.numel():
            raise RuntimeError(f"commopt: shared-device rendezvous: rank {r}'s buffer is {t.numel()} elements on {t.device}, "
                               f"expected {local.numel()} on {local.device}")
    return IpcHandle(mapped)
