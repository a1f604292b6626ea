"""kernels/gpu/driver.py's batched stream memory operations on one GPU: a batch's writes land in
order after the stream's earlier work, its waits hold the stream, and a batch captured in a
CUDA graph does the same on every replay.  Fresh random values, never the flags' resting ones."""

from __future__ import annotations

import pytest
import torch


def _flags(n: int = 64) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int32, device="cuda")


def test_batch_writes_in_order_after_earlier_work(one_gpu):
    from torch_commopt.kernels.gpu import driver

    flags = _flags()
    values = torch.randint(2, 1 << 30, (8,)).tolist()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000)  # earlier work the fenced writes must come after
    ops = [("write", flags.data_ptr() + 4 * i, v) for i, v in enumerate(values)]
    ops.append(("write", flags.data_ptr(), values[0] + 1))  # a later write to the same word wins
    driver.batch(stream, ops)
    torch.cuda.synchronize()
    assert flags[:8].tolist() == [values[0] + 1] + values[1:]


def test_batch_wait_holds_the_stream_until_a_write_elsewhere(one_gpu):
    from torch_commopt.kernels.gpu import driver

    flags, other = _flags(), torch.cuda.Stream()
    value = int(torch.randint(2, 1 << 20, ()).item())
    stream = torch.cuda.current_stream()
    # the stream waits for flag 0 >= value, then writes flag 1; the other stream sets flag 0 later
    driver.batch(stream, [("wait", flags.data_ptr(), value), ("write", flags.data_ptr() + 4, value + 7)])
    marker = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    marker.fill_(value)  # queued behind the wait on `stream`
    with torch.cuda.stream(other):
        torch.cuda._sleep(2_000_000)
        driver.write_value32(other, flags.data_ptr(), value)
    torch.cuda.synchronize()
    assert flags[:2].tolist() == [value, value + 7] and marker.item() == value


def test_batch_replayed_from_a_cuda_graph(one_gpu):
    from torch_commopt.kernels.gpu import driver

    flags = _flags()
    base = flags.data_ptr()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    with torch.cuda.graph(graph, stream=side):
        # a closed protocol: raise flag 2, wait for it, count, lower it again
        driver.batch(side, [("write", base + 8, 1), ("wait", base + 8, 1)])
        counter.add_(1)
        driver.batch(side, [("write", base + 8, 0), ("write", base + 12, 1)])
    replays = int(torch.randint(3, 9, ()).item())
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert counter.item() == replays and flags[2:4].tolist() == [0, 1]


def test_batch_refuses_bad_operations(one_gpu):
    from torch_commopt.kernels.gpu import driver

    flags = _flags()
    with pytest.raises(ValueError, match="unknown stream memory operation"):
        driver.batch(torch.cuda.current_stream(), [("add", flags.data_ptr(), 1)])
    with pytest.raises(ValueError, match="at most"):
        driver.batch(torch.cuda.current_stream(), [("write", flags.data_ptr(), 1)] * (driver.MAX_BATCH + 1))
