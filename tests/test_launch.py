"""launch.run_distributed: results per rank, failures reported, crashes found without waiting."""

from __future__ import annotations

import time

import pytest

from torch_commopt.testing.launch import run_distributed


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


def _env_and_modules(rank: int, world: int, names: tuple[str, ...]) -> tuple[dict, bool]:
    import os
    import sys

    return {n: os.environ.get(n) for n in names}, "torch._inductor.compile_fx" in sys.modules


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    # the fork server (started by an earlier call) keeps the environment it began with; a rank
    # must see the caller's as it is now: a variable set since, one removed since
    monkeypatch.setenv("COMMOPT_LAUNCH_TEST_GONE", "before")
    run_distributed(_rank_squared, 2, 0)
    monkeypatch.setenv("COMMOPT_LAUNCH_TEST_SET", "now")
    monkeypatch.delenv("COMMOPT_LAUNCH_TEST_GONE")
    names = ("COMMOPT_LAUNCH_TEST_SET", "COMMOPT_LAUNCH_TEST_GONE")
    for env, _ in run_distributed(_env_and_modules, 2, names):
        assert env == {"COMMOPT_LAUNCH_TEST_SET": "now", "COMMOPT_LAUNCH_TEST_GONE": None}


def test_ranks_start_from_a_server_that_imported_the_package():
    import multiprocessing

    from torch_commopt.testing import launch

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork server on this platform: the ranks are spawned")
    assert launch._context().get_start_method() == "forkserver"  # the CPU suite has no CUDA device
    # (importing torch_commopt alone, as a spawned rank unpickling this test does, leaves it out)
    assert all(preloaded for _, preloaded in run_distributed(_env_and_modules, 2, ()))


def _warm_state(rank: int, world: int) -> tuple[int, int, int]:
    import threading

    from torch._inductor import cpu_vec_isa
    from torch._inductor.fx_passes import joint_graph

    return (cpu_vec_isa.valid_vec_isa_list.cache_info().currsize, len(threading.enumerate()),
            joint_graph.lazy_init.cache_info().currsize)


@pytest.mark.slow
def test_forked_ranks_start_with_inductors_once_per_process_work_done():
    import multiprocessing
    import subprocess
    import sys

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork server on this platform: the ranks are spawned")
    # in the rank, before any compile: the ISA probe and the pattern tracing are already cached,
    # and the only thread is the rank's own (the server must not fork with another one running)
    assert run_distributed(_warm_state, 2) == [(1, 1, 1)] * 2
    # the same for a fresh process that only imports the module (the server's own state)
    code = ("import threading, torch_commopt.testing.warm as w; from torch._inductor import cpu_vec_isa; "
            "print(len(threading.enumerate()), cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "1"], out.stdout + out.stderr


def test_ranks_that_may_use_cuda_are_spawned(monkeypatch):
    # a fork server's preload initializes CUDA, and torch refuses CUDA in a process forked after
    import torch

    from torch_commopt.testing import launch

    assert launch._context("nccl").get_start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # e.g. gloo ranks sharing a GPU
    assert launch._context("gloo").get_start_method() == "spawn"
