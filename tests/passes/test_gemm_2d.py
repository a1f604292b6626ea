"""The 2D GEMM finder and rewrite (passes/matmul/gemm_2d.py) on hand-built post-grad graphs: the
form DTensor emits for X @ W with both sharded over a 2D mesh, what is refused and why, the slice
count the model picks, and the graph after the rewrite.  Numerics: tests/test_mesh_2d.py."""

from __future__ import annotations

import operator

import pytest
import torch
from hand_graphs import builder, gather_split_cat

from torch_commopt.kernels.mesh2d.ops import out_shape
from torch_commopt.passes.graph_utils import ALL_GATHER, MM, REDUCE_SCATTER, WAIT, aten
from torch_commopt.passes.matmul.gemm_2d import find_gemm_2d, pick_slices, rewrite_gemm_2d


def _builder(x_block, other_block):
    """A graph with placeholders x and other holding meta values of the blocks' shapes, and
    node(target, args, shape) (hand_graphs.builder)."""
    return builder(x_block, other_block, names=("x", "other"))


def _graph(x_block=(16, 32), w_block=(32, 24), groups=("cols", "rows"), mesh=(2, 2), x_extra_use=False):
    """X [M/R, K/C] gathered over `groups[0]` (C ranks) along dim 1 (split / cat), W [K/R, N/C] over
    `groups[1]` (R ranks) along dim 0, and their mm."""
    r, c = mesh
    g, node, x, w = _builder(x_block, w_block)
    _, cat = gather_split_cat(g, node, x, c, groups[0], 1)
    ag_w = node(ALL_GATHER, (w, r, groups[1]), (r * w_block[0], w_block[1]))
    wait_w = node(WAIT, (ag_w,), (r * w_block[0], w_block[1]))
    mm = node(MM, (cat, wait_w), (x_block[0], w_block[1]))
    outs = [mm] + ([node(aten.relu.default, (cat,), (x_block[0], c * x_block[1]))] if x_extra_use else [])
    g.output(tuple(outs))
    return g


def test_dtensors_two_axis_matmul_is_one_region():
    (region,), skips = find_gemm_2d(_graph())
    assert skips == []
    assert (region.rows_group, region.cols_group, region.rows, region.cols) == ("rows", "cols", 2, 2)
    assert region.global_mnk == (32, 48, 64)  # M = 16 x 2, N = 24 x 2, K = 32 x 2
    assert region.summary()["mesh"] == [2, 2] and region.summary()["dataflow"] == "os"


def test_a_non_square_mesh_matches_k_across_its_axes():
    # a 2 x 4 mesh: X's K block is K/4, W's K/2
    (region,), _ = find_gemm_2d(_graph(x_block=(16, 16), w_block=(32, 24), mesh=(2, 4)))
    assert (region.rows, region.cols) == (2, 4) and region.global_mnk == (32, 96, 64)


def test_what_is_not_a_2d_gemm_is_said_and_left_to_the_1d_finders():
    assert find_gemm_2d(_graph(groups=("tp", "tp")))[0] == []  # one group: a 1-D mesh
    regions, skips = find_gemm_2d(_graph(x_extra_use=True))
    assert regions == [] and ["other uses" in s.reason for s in skips] == [True]
    regions, skips = find_gemm_2d(_graph(x_block=(16, 32), w_block=(48, 24)))  # K blocks that do not meet
    assert regions == [] and "K does not match" in skips[0].reason


def test_the_model_slices_a_large_gemm_and_not_a_tiny_one():
    (tiny,), _ = find_gemm_2d(_graph())
    assert pick_slices(tiny)[0] == 1  # microseconds of GEMM against a collective's fixed cost
    (large,), _ = find_gemm_2d(_graph(x_block=(4096, 4096), w_block=(4096, 4096)))
    s, times = pick_slices(large)
    assert s > 1 and times[s] < times[1] and set(times) == {1, 2, 4, 8, 16}


def test_the_rewrite_leaves_one_op_and_no_collective():
    g = _graph()
    (region,), _ = find_gemm_2d(g)
    node = rewrite_gemm_2d(g, region, 4)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert targets == [torch.ops.commopt.gemm_2d.default, operator.getitem]
    op = node.args[0]
    assert op.args[2:] == ("os", 4, 2, 2, "rows", "cols", False, "") and list(node.meta["val"].shape) == [16, 24]


def _linear_graph(x_block=(16, 32), b_block=(32, 24), mesh=(2, 2), keep=False):
    """F.linear on a 2D mesh as DTensor emits it: X [M/R, K/C] gathered along its rows over "rows"
    (R ranks), times the W block (transposed) [K/C, N/R], reduce-scattered along the rows over
    "cols" (C ranks).  keep: the gathered X is also a graph output (saved for the backward)."""
    r, c = mesh
    g, node, x, b = _builder(x_block, b_block)
    ag = node(ALL_GATHER, (x, r, "rows"), (r * x_block[0], x_block[1]))
    wait = node(WAIT, (ag,), (r * x_block[0], x_block[1]))
    mm = node(MM, (wait, b), (r * x_block[0], b_block[1]))
    rs = node(REDUCE_SCATTER, (mm, "sum", c, "cols"), (r * x_block[0] // c, b_block[1]))
    out = node(WAIT, (rs,), (r * x_block[0] // c, b_block[1]))
    g.output((out, wait) if keep else (out,))
    return g


@pytest.mark.parametrize("keep", [False, True], ids=["alone", "gathered kept"])
def test_f_linears_gather_and_reduce_scatter_are_one_rs_region(keep):
    g = _linear_graph(keep=keep)
    (region,), skips = find_gemm_2d(g)
    assert skips == [] and region.dataflow == "rs" and region.keep_gathered == keep
    # the op's mesh: rows = the reduce-scatter's group (K blocks), cols = the gather's (M blocks)
    assert (region.rows_group, region.cols_group, region.rows, region.cols) == ("cols", "rows", 2, 2)
    assert region.global_mnk == (32, 48, 64)  # M = 16 x 2, N = 24 x 2, K = 32 x 2
    node = rewrite_gemm_2d(g, region, 2)
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert targets == [aten.permute.default, torch.ops.commopt.gemm_2d.default, operator.getitem] + (
        [operator.getitem] if keep else [])
    assert list(node.meta["val"].shape) == [16, 24]
    outputs = list(g.output_node().args[0])
    assert outputs[0] is node and (not keep or outputs[1].args == (node.args[0], 1))


def test_a_product_reduce_scattered_over_the_gathers_own_group_is_1d_tp_and_not_listed():
    # (1-D TP's gather -> mm -> reduce-scatter: ag_matmul's, and no skip note in every TP program)
    g = _linear_graph()
    rs = next(n for n in g.nodes if n.target is REDUCE_SCATTER)
    rs.args = (rs.args[0], "sum", 2, "rows")
    assert find_gemm_2d(g) == ([], [])


def test_a_product_reduce_scattered_with_max_is_said():
    g = _linear_graph()
    rs = next(n for n in g.nodes if n.target is REDUCE_SCATTER)
    rs.args = (rs.args[0], "max", 2, "cols")
    regions, skips = find_gemm_2d(g)
    assert regions == [] and "not summed" in skips[0].reason


def test_the_ops_block_shape_per_dataflow():
    assert out_shape("os", (16, 32), (32, 24), 2, 4) == [16, 24]
    assert out_shape("ls", (16, 32), (12, 32), 2, 4) == [16, 6]  # W [N/R, K/C]: N = 24 -> N/C = 6
    assert out_shape("rs", (32, 8), (32, 24), 2, 4) == [16, 24]  # X [K/R, M/C]: M = 32 -> M/R = 16
