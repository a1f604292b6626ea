"""The ops' host timer (TORCH_COMMOPT_HOST_TIMING): calls and seconds per op and thread.  CPU only."""

from __future__ import annotations

import pytest

from torch_commopt.kernels.matmul import ops


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
