"""Shared fixtures: a single-process fake process group of any world size.  The suite's tuner
cache is a fresh directory (pytest_configure), never the user's: a calibration or measurement
stored there by a benchmark would change what the model and autotune tests decide."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import torch_commopt
from torch_commopt.tuner.cache import CACHE_ENV


def pytest_configure(config):
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="commopt_test_cache_")  # before any test spawns ranks (they inherit it)


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
