"""The GPU schedules' Triton kernels run by Triton's CPU interpreter (triton_interpret_cases.py
says which kernels, which paths, and what the interpreter cannot run); tests/gpu runs them on
GPUs.  The groups run in a process of their own: TRITON_INTERPRET must be set before a kernel
is decorated."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_interpret_cases.py")


def _interpreter_indexes_by_scalars() -> bool:
    """Triton 3.6's interpreter turns a scalar argument into an index with int() of a
    one-element array (a `range(pid, n, num_progs)` in a kernel), which numpy >= 2.4 refuses;
    3.7 squeezes it first.  The persistent GEMMs loop so; the merge kernel does not."""
    import numpy as np
    import triton

    try:
        int(np.array([1]))
        return True
    except TypeError:
        return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 7)


GROUPS = ["ag", "rs", "waits", "ll"]


def test_gpu_kernels_in_the_interpreter(triton_interpreter):
    if not _interpreter_indexes_by_scalars():
        pytest.skip("this Triton's interpreter cannot index by a scalar argument under this numpy (Triton >= 3.7 can)")
    res = subprocess.run([sys.executable, CASES, *GROUPS], env=triton_interpreter, capture_output=True, text=True,
                         timeout=300)
    passed = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("ok ")]
    assert res.returncode == 0 and passed == GROUPS, f"passed {passed} of {GROUPS}\n" + res.stderr[-4000:]
