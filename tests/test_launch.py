"""launch.run_distributed: results per rank, failures reported, crashes found without waiting."""

from __future__ import annotations

import time

import pytest

from torch_commopt.launch import run_distributed


def _rank_squared(rank: int, world: int, offset: int) -> int:
    return rank * rank + offset


def _rank_one_raises(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure on rank 1")
    return rank


def _rank_one_dies(rank: int, world: int) -> int:
    import os
    import signal

    import torch.distributed as dist

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a segfault in native code would: no report
    dist.barrier()  # rank 0 now waits for a peer that is gone
    return rank


def _rank_one_uses_the_store_late(rank: int, world: int) -> str:
    import torch.distributed as dist

    if rank == 1:  # rank 0 (the store's host) has returned by now
        time.sleep(1.5)
        store = dist.distributed_c10d._get_default_store()
        store.set("late", "still here")
        return store.get("late").decode()
    return "done"


def test_rank_0_keeps_the_store_up_until_every_rank_is_done():
    assert run_distributed(_rank_one_uses_the_store_late, 2) == ["done", "still here"]


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_squared, 2, 5) == [5, 6]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="planted failure on rank 1"):
        run_distributed(_rank_one_raises, 2)


def test_a_rank_killed_by_a_signal_is_reported_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\[rank 1\] process exited with code -9 without reporting"):
        run_distributed(_rank_one_dies, 2, timeout_s=600)
    assert time.monotonic() - start < 120
