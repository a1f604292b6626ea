"""B-side gathers (passes/matmul/b_gather.py) on hand-built post-grad graphs: the column gather of
a matmul's second operand -- DTensor's dW = Xᵀ dY in the backward of a 2D output-stationary GEMM --
turned into a row gather of the first, which the all-gather -> matmul finder then takes; what is
left alone.  Numerics: tests/test_mesh_2d.py (the 2D GEMM's backward against eager)."""

from __future__ import annotations

from hand_graphs import builder, gather_split_cat
from torch.fx import Graph

from torch_commopt.passes.graph_utils import ALL_GATHER, MM, WAIT, aten
from torch_commopt.passes.matmul.b_gather import transpose_b_gathers
from torch_commopt.passes.matmul.find_ag_matmul import find_ag_matmul


def _graph(a_shape=(32, 16), b_shape=(16, 24), world=2, b_as_first=False, cat_reused=False, cat_dim=1):
    """mm(A, cat(split(wait(all_gather(b)), rows), cat_dim)) over group "cols"."""
    g, node, a, b = builder(a_shape, b_shape, names=("a", "b"))
    _, cat = gather_split_cat(g, node, b, world, "cols", cat_dim)
    cat_shape = tuple(cat.meta["val"].shape)
    if b_as_first:
        mm = node(MM, (cat, a), (cat_shape[0], a_shape[1]))
    else:
        mm = node(MM, (a, cat), (a_shape[0], cat_shape[1]))
    outs = [mm] + ([node(aten.relu.default, (cat,), cat_shape)] if cat_reused else [])
    g.output(tuple(outs))
    return g


def _calls(g: Graph, target) -> list:
    return [n for n in g.nodes if n.op == "call_function" and n.target is target]


def test_a_column_gathered_second_operand_becomes_a_row_gathered_first_one():
    g = _graph()
    (note,) = transpose_b_gathers(g)
    assert "B-side gather" in note
    g.lint()
    assert not _calls(g, aten.cat.default) and not _calls(g, aten.split.Tensor)
    (ag,) = _calls(g, ALL_GATHER)
    shard = ag.args[0]  # bᵀ made contiguous, gathered along dim 0 over the same group
    assert shard.target is aten.clone.default and shard.args[0].target is aten.permute.default
    assert ag.args[1:] == (2, "cols") and tuple(ag.meta["val"].shape) == (48, 16)
    (mm,) = _calls(g, MM)
    assert mm.args[0].target is WAIT and tuple(mm.meta["val"].shape) == (48, 32)  # (A B)ᵀ
    out = g.output_node().args[0][0]  # the product as the graph had it: [32, 48], contiguous
    assert out.target is aten.clone.default and tuple(out.meta["val"].shape) == (32, 48)
    assert out.meta["val"].stride() == (48, 1)
    (region,), skips = find_ag_matmul(g)  # what the turn is for: an ag_matmul region, gathered along dim 0
    assert region.dim == 0 and skips == []


def test_what_is_not_a_column_gather_of_the_second_operand_is_left_alone():
    for kwargs in ({"b_as_first": True},  # the gather feeds the first operand: ag_matmul's own form
                   {"cat_reused": True},  # the gathered tensor has another reader
                   {"cat_dim": 0}):  # gathered along the rows: the contracted dim of the second operand
        g = _graph(**kwargs)
        before = len(g.nodes)
        assert transpose_b_gathers(g) == [], kwargs
        assert len(g.nodes) == before and _calls(g, aten.cat.default), kwargs


def test_a_compiled_column_gather_into_the_second_operand_matches_eager_forward_and_backward():
    """The turn in a traced program (funcol's all_gather_tensor along dim 1 into x @ w, 2 gloo ranks,
    float64): an ag_matmul region in the forward, the loss and the weight's gradient as eager's.
    (Where the gathered weight is also saved for a dX, the turn is not taken: its other reader
    would need the untransposed layout, a copy of the whole gathered weight.)"""
    from b_gather_programs import b_gather_fwd_bwd

    from torch_commopt.testing.launch import run_distributed

    for rank, (notes, rewritten, loss_err, grad_errs) in enumerate(run_distributed(b_gather_fwd_bwd, 2, timeout_s=300)):
        assert [n for n in notes if "B-side gather" in n], (rank, notes)
        assert "ag_matmul" in [kind for kind, _ in rewritten], (rank, rewritten)
        assert loss_err < 1e-12 and max(grad_errs) < 1e-12, (rank, loss_err, grad_errs)
