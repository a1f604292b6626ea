"""Shared fixtures: a single-process fake process group of any world size; the environment
of a process running Triton kernels in Triton's CPU interpreter.  The suite's tuner cache is a
fresh directory (pytest_configure), never the user's: a calibration or measurement stored
there by a benchmark would change what the model and autotune tests decide."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import torch_commopt
from torch_commopt.tuner.cache import CACHE_ENV

# The suite's cache directory is made fresh for each session.  COMMOPT_TEST_CACHE_DIR names
# one to use instead, warm or not (to check that the suite passes with what an earlier run
# left there: `COMMOPT_TEST_CACHE_DIR=$(mktemp -d)`, then pytest twice); never the user's.
TEST_CACHE_ENV = "COMMOPT_TEST_CACHE_DIR"


def pytest_configure(config):
    # before any test spawns ranks (they inherit it)
    named = os.environ.get(TEST_CACHE_ENV)
    os.environ[CACHE_ENV] = named or tempfile.mkdtemp(prefix="commopt_test_cache_")
    config._commopt_made_cache = None if named else os.environ[CACHE_ENV]


def pytest_unconfigure(config):
    # the session's own cache directory goes with it (one named by COMMOPT_TEST_CACHE_DIR stays)
    made = getattr(config, "_commopt_made_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def fake_world(request):
    """init_process_group("fake") with world size request.param (default 2); yields the size."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = getattr(request, "param", 2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    try:
        yield world
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


@pytest.fixture
def triton_interpreter():
    """The environment for a subprocess that runs Triton kernels in Triton's CPU interpreter
    (TRITON_INTERPRET=1, this process's sys.path).  Triton is in the test extras: where it is
    missing the test is skipped, except under CI (CI=true), where that is a failure: a missing
    install must not pass for a run."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI"):
            pytest.fail("triton is not installed: `pip install -e .[test]` installs it for the interpreter tests")
        pytest.skip("triton is not installed (pip install -e .[test])")
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
