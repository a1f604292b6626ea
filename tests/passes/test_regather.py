"""Config.regather_for_backward (passes/matmul/regather.py) on gloo: the shard is saved, the
backward gathers again, and forward and backward still match eager."""

from __future__ import annotations

import pytest

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance

# tp_sp_block (seq 16, dim 64, fp32, W=2) gathers two norm outputs of 2x16x64x4 B = 8 KiB each, 4 KiB
# of each kept beyond its shard: a budget of 5 KiB keeps one and re-gathers the other, 0 keeps none,
# a large one re-gathers nothing (as no budget); regather_for_backward re-gathers both.  Every case
# in one spawn (its MLP is tp_sp_mlp's: the block alone).
BUDGETS = (1.0, 5 / 1024, 0.0)


@pytest.fixture(scope="module")
def regather_runs():
    from regather_programs import saved_and_gathers_by_option

    return run_distributed(saved_and_gathers_by_option, 2, "tp_sp_block", BUDGETS)


def _exact(run):
    return [f"{n}: {c:.2e} vs eager {e:.2e}" for n, c, e in run[2] if not within_tolerance(c, e)]


def test_regather_saves_the_shard_and_gathers_again_in_backward(regather_runs):
    for runs in regather_runs:
        (saved0, gathers0, _, _), (saved1, gathers1, _, _) = runs[1.0], runs["regather"]
        assert gathers1 > gathers0, (gathers0, gathers1)  # the forward's gathers run again
        assert saved1 < saved0, (saved0, saved1)  # shards saved instead of gathered results
        assert not _exact(runs["regather"]), _exact(runs["regather"])


def test_only_forward_gathers_are_marked():
    import torch
    from torch.fx import Graph
    from torch.utils.checkpoint import CheckpointPolicy

    from torch_commopt.passes.matmul.regather import mark_regather

    ag = torch.ops._c10d_functional.all_gather_into_tensor.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    g = Graph()
    x, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
    fwd = g.call_function(wait, (g.call_function(ag, (x, 2, "0")),))
    g.call_function(torch.ops.aten.view.default, (fwd, [-1]))
    bwd = g.call_function(wait, (g.call_function(ag, (t, 2, "0")),))
    g.output((fwd, bwd))
    notes = mark_regather(g)
    marked = [n for n in g.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE]
    assert len(notes) == 1 and len(marked) == 3  # the forward gather, its wait and the view
    assert bwd not in marked and bwd.args[0] not in marked


def test_saved_gather_budget_regathers_only_what_does_not_fit(regather_runs):
    for rank, runs in enumerate(regather_runs):
        saved = {b: runs[b][0] for b in BUDGETS}
        gathers = {b: runs[b][1] for b in BUDGETS}
        assert saved[0.0] < saved[5 / 1024] < saved[1.0], saved
        assert gathers[0.0] == gathers[1.0] + 2 and gathers[5 / 1024] == gathers[1.0] + 1, gathers
        notes = runs[5 / 1024][3]
        assert any("re-gather 1 of 2" in n for n in notes), notes
        for b in BUDGETS:
            assert not _exact(runs[b]), (rank, b, _exact(runs[b]))


def test_saved_gather_budget_is_validated():
    from torch_commopt.config import Config

    with pytest.raises(ValueError, match="saved_gather_budget_mib"):
        Config(saved_gather_budget_mib=-1)
    with pytest.raises(ValueError, match="set one of the two"):
        Config(saved_gather_budget_mib=10, regather_for_backward=True)
