"""Expert-parallel schedules (kernels/moe) on GPUs: the same cases as on gloo
(tests/kernels/moe_cases.py), float64 against one process on the CPU running every expert over
every rank's tokens.  With NCCL, by_peer's posted transfers run on NCCL's stream under the experts."""

from __future__ import annotations

import pytest
from moe_cases import run_schedules

from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
def test_every_schedule_matches_one_process_on_gpus(two_ranks):
    world, backend = two_ranks
    for results in run_distributed(run_schedules, world, ("balanced", "skewed"), "cuda", backend=backend,
                                   timeout_s=300):
        assert len(results) == 4
        bad = [(case, err) for case, err in results if not err <= 1e-12]
        assert not bad, bad
