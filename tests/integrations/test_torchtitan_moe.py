"""torchtitan 0.2.2's MoE layer with expert parallelism on gloo (2 ranks): commopt's schedules
swapped in for torchtitan's token dispatch and combine give the unsharded layer's output and every
parameter's gradient (titan_moe_cases.py), also when the layer is given to torch_commopt.optimize."""

from __future__ import annotations

import pytest

from torch_commopt.testing.optional import torchtitan_or_skip

torchtitan_or_skip()

from titan_moe_cases import run_moe_layer  # noqa: E402

from torch_commopt.testing.launch import run_distributed  # noqa: E402


# 2 ranks: the schedules at 4 ranks are tests/kernels/test_moe_schedules.py's (the layer adds nothing per rank)
@pytest.mark.parametrize("world,grouped,extra", [
    pytest.param(2, False, ("optimize by_expert:2", "optimize auto"), marks=pytest.mark.slow), (2, True, ())],
    ids=["w2 loop", "w2 grouped"])
def test_swapped_schedules_match_the_unsharded_layer(world, grouped, extra):
    schedules = ("a2a", "by_peer", "by_expert") + extra
    for results in run_distributed(run_moe_layer, world, schedules, grouped, backend="gloo", timeout_s=300):
        assert [case.split(" world")[0] for case, _ in results] == ["torchtitan", *schedules]
        # fp32; the grouped path computes the experts in bf16 (torchtitan's _run_experts_grouped_mm)
        tol = 2e-2 if grouped else 1e-5
        bad = [(case, err) for case, err in results if not err <= tol]
        assert not bad, bad
