"""benchmarks/probe_host_step.py's summary of py-spy's raw samples, and the ops' host timer
(TORCH_COMMOPT_HOST_TIMING) it reads in --timing mode.  CPU only."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_host_step  # noqa: E402

from torch_commopt.kernels import ops  # noqa: E402

RAW = """\
thread (11): MainThread;<module> (<string>:1);_window (probe_host_step.py:146);ag_matmul (torch_commopt/kernels/ops.py:196);cuLaunchKernel (libcuda.so.580) 3
thread (11): MainThread;<module> (<string>:1);_window (probe_host_step.py:146);all_gather_tensor (torch/distributed/_functional_collectives.py:10);dispatch (a.py:1) 2
thread (11): MainThread;<module> (<string>:1);worker (probe_host_step.py:120);clock_nanosleep (libc.so.6) 50
thread (12);Engine::evaluate_function (libtorch_cpu.so);matmul_rs (torch_commopt/kernels/ops.py:262);pthread_cond_wait (libc.so.6) 4
thread (12);Engine::evaluate_function (libtorch_cpu.so);at::_ops::mm::call (libtorch_cpu.so) 1
"""


def test_summary_counts_the_window_by_thread_area_and_leaf(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(RAW)
    got = probe_host_step.summarize(raw, rate=1000, steps=1)
    main, other = got["thread : MainThread"], got["thread"]
    # the main thread outside _window (the attach wait, the synchronize after) is not counted
    assert main["ms_per_step"] == 5.0
    assert main["by_area_ms"] == {"commopt op": 3.0, "NCCL collective": 2.0}
    assert main["by_leaf_ms"] == {"driver call (ctypes)": 3.0, "python": 2.0}
    assert main["commopt_op_by_leaf_ms"] == {"driver call (ctypes)": 3.0}
    assert other["ms_per_step"] == 5.0 and other["by_area_ms"] == {"commopt op": 4.0, "other": 1.0}
    assert other["by_leaf_ms"] == {"waiting (futex, condition, sleep)": 4.0, "dispatcher / ATen": 1.0}
    assert ("matmul_rs (torch_commopt/kernels/ops.py:262)", 4.0) in other["top_inclusive_ms"]
    # per step: the samples over the steps at the rate
    assert probe_host_step.summarize(raw, rate=500, steps=2)["thread : MainThread"]["ms_per_step"] == 5.0


def test_the_host_timer_adds_calls_and_seconds_per_op_and_thread():
    ops.HOST_TIMES.clear()
    timed = ops._timed("probe_op", lambda x: x + 1)
    assert timed(1) == 2 and timed(2) == 3
    calls, wall, cpu = ops.HOST_TIMES["probe_op", "MainThread"]
    assert calls == 2 and wall > 0 and cpu >= 0

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):  # a call that raises is still counted, and raises
        ops._timed("probe_op", fails)()
    assert ops.HOST_TIMES["probe_op", "MainThread"][0] == 3
    ops.HOST_TIMES.clear()
