"""A corrupted or unwritable tuner cache on the rank that answers for the group: every rank
still compiles the same schedules and the results stay exact."""

from __future__ import annotations

import shutil

import pytest
from tuner_programs import compile_with_autotune, compile_with_cache_fault

from torch_commopt.testing.launch import run_distributed


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A tuner cache filled by an autotuned compile (each test faults a copy of it)."""
    warm = tmp_path_factory.mktemp("warm_cache")
    run_distributed(compile_with_autotune, 2, str(warm), timeout_s=600)
    return warm


@pytest.mark.parametrize("fault", ["corrupt", "unwritable"])
def test_a_faulty_cache_on_rank_0_leaves_every_rank_agreeing(tmp_path, fault, warm):
    for rank in range(2):
        shutil.copytree(warm, tmp_path / f"rank{rank}")
    results = run_distributed(compile_with_cache_fault, 2, str(tmp_path), fault, timeout_s=600)
    ((_, scheds0, notes0, err0, _, _),), ((_, scheds1, _, err1, _, _),) = results
    assert err0 < 1e-5 and err1 < 1e-5
    assert scheds0 == scheds1  # rank 1's warm cache is not consulted: rank 0 answers for the group
    # rank 0 found no usable entry: the regions are timed again at their first call, on every rank
    assert all(s.startswith("autotune:1:id=") for s in scheds0), scheds0
    assert sum("autotune measured" in n for n in notes0) == 2, notes0
