"""Config.regather_for_backward (passes/regather.py) on gloo: the shard is saved, the
backward gathers again, and forward and backward still match eager."""

from __future__ import annotations

import pytest

from torch_commopt.launch import run_distributed
from torch_commopt.validate import within_tolerance


@pytest.mark.parametrize("kind", ["tp_sp_mlp", "tp_sp_block"])
def test_regather_saves_the_shard_and_gathers_again_in_backward(kind):
    from regather_programs import saved_and_gathers

    base = run_distributed(saved_and_gathers, 2, kind, False)
    again = run_distributed(saved_and_gathers, 2, kind, True)
    for (saved0, gathers0, _), (saved1, gathers1, errors) in zip(base, again):
        assert gathers1 > gathers0, (gathers0, gathers1)  # the forward's gathers run again
        assert saved1 < saved0, (saved0, saved1)  # shards saved instead of gathered results
        bad = [f"{n}: {c:.2e} vs eager {e:.2e}" for n, c, e in errors if not within_tolerance(c, e)]
        assert not bad, bad


def test_only_forward_gathers_are_marked():
    import torch
    from torch.fx import Graph
    from torch.utils.checkpoint import CheckpointPolicy

    from torch_commopt.passes.regather import mark_regather

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
