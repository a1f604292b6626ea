"""kernels/gpu/shared_device: the handle's views and the rendezvous's exchange, on CPU tensors over
gloo (the same reduce/rebuild path CUDA IPC takes, with shared memory in place of IPC handles)."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.kernels.gpu import shared_device
from torch_commopt.testing.launch import run_distributed


def test_views_address_each_ranks_copy_by_element_offset():
    mapped = [torch.arange(16, dtype=torch.int32) + 100 * r for r in range(2)]
    handle = shared_device.IpcHandle(mapped)
    assert handle.buffer_ptrs == [t.data_ptr() for t in mapped]
    view = handle.get_buffer(1, (2, 3), torch.int32, 4)
    assert view.tolist() == [[104, 105, 106], [107, 108, 109]]
    view.fill_(-1)  # a view aliases the rank's copy
    assert mapped[1][4:10].tolist() == [-1] * 6
    assert handle.get_buffer(0, (4,), torch.int16, 0).shape == (4,)  # reinterpreted, not converted
    with pytest.raises(ValueError, match="outside 16 elements"):
        handle.get_buffer(0, (4,), torch.int32, 13)


def test_the_switch_and_on_cuda(monkeypatch):
    monkeypatch.delenv(shared_device.ENV, raising=False)
    assert not shared_device.enabled()
    assert shared_device.on_cuda("nccl") and shared_device.on_cuda("cpu:gloo,cuda:nccl")
    assert not shared_device.on_cuda("gloo")
    monkeypatch.setenv(shared_device.ENV, "1")
    assert shared_device.enabled()
    assert shared_device.on_cuda("gloo") == torch.cuda.is_available()


def _exchange(rank: int, world: int) -> list[float]:
    import torch.distributed as dist
    import torch.multiprocessing

    # a CPU tensor's fd-strategy handle can be taken once, by one peer; CUDA IPC handles any number
    torch.multiprocessing.set_sharing_strategy("file_system")
    local = torch.empty(8, dtype=torch.float32)
    local.fill_(-1.0)
    handle = shared_device.rendezvous(local, dist.group.WORLD)
    peer = (rank + 1) % world
    handle.get_buffer(peer, (2,), torch.float32, 2 * rank).fill_(float(10 + rank))  # into the peer's copy
    dist.barrier()
    return local.tolist()


def test_rendezvous_maps_every_ranks_buffer_into_every_process():
    got = run_distributed(_exchange, 3, timeout_s=120)
    for rank, values in enumerate(got):
        writer = (rank - 1) % 3
        expected = [-1.0] * 8
        expected[2 * writer: 2 * writer + 2] = [10.0 + writer] * 2
        assert values == expected, (rank, values)
