"""Host-replayed eager calls on the GPU against float64 truth and the Python host code (host_replay_cases)."""

from __future__ import annotations

import pytest
from host_replay_cases import run_host_replay

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.gpu
def test_replayed_calls_match_the_reference_and_the_python_host_code(two_ranks):
    calls = 10
    for results, stats, n_cases in run_distributed(run_host_replay, two_ranks[0], calls, backend=two_ranks[1], timeout_s=300):
        bad = [f"{name}: error {err:.2e} vs sequential {ref:.2e}" for name, err, ref, _ in results
               if not within_tolerance(err, ref)]
        assert not bad, "\n".join(bad)
        # each replayed call is followed by a Python one of the same schedule, so every replayed
        # call takes the same buffer half: per case a first call, two recordings, then replays
        assert stats["replayed"] == n_cases * (calls - 3), (stats, n_cases)
        assert stats["recorded"] == 2 * n_cases, (stats, n_cases)
        unequal = [name for name, _, _, same in results if not same]
        assert not unequal, f"replayed GEMMs differ from ATen's: {unequal[:4]}"
