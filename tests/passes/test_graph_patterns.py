"""Graph tests (single process, fake process group): which regions are found, and what the
rewritten graph holds.  Includes the patterns of PyTorch's async-TP tests, written anew."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from dist_programs import FUNCOL_GATHER_DIM_TRACES, all_gather_on

import torch_commopt

WORLDS = [2, 4, 8]
world_param = pytest.mark.parametrize("fake_world", WORLDS, indirect=True)


def compiled_graphs(fn, *inputs, **options):
    torch_commopt.reset_explain()
    torch.compile(fn, backend="commopt", options=options or None)(*inputs)
    return torch_commopt.explain().graphs


def only_graph(fn, *inputs, **options):
    (graph,) = compiled_graphs(fn, *inputs, **options)
    return graph


def group():
    return dist.group.WORLD.group_name




def assert_rewritten(graph, kind, count=1, collective=None):
    collective = collective or {"ag_matmul": "all_gather", "matmul_rs": "reduce_scatter", "matmul_ar": "all_reduce"}[kind]
    assert [r.kind for r in graph.rewritten].count(kind) == count, graph
    assert graph.commopt_ops.get(kind) == count
    assert graph.collectives_after.get(collective, 0) == graph.collectives_before[collective] - count


# --- all-gather -> matmul -------------------------------------------------------------------

@world_param
@pytest.mark.parametrize("a_dims,gather_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
@pytest.mark.parametrize("return_a", [True, False])
def test_all_gather_matmul_any_gather_dim(fake_world, a_dims, gather_dim, return_a):
    # async-TP's test_fuse_all_gather_matmul: A = all_gather(A_shard, gather_dim); A @ B.
    shape = [64, 32] if a_dims == 2 else [2, 64, 32]
    shape[gather_dim] //= fake_world if gather_dim != a_dims - 1 else 1
    if gather_dim == a_dims - 1:
        shape[-1] = 32 // fake_world
    a_shard, b = torch.randn(*shape), torch.randn(32, 16)

    def fn(a_shard, b):
        a = all_gather_on(a_shard, gather_dim)
        return (a, a @ b) if return_a else a @ b

    graph = only_graph(fn, a_shard, b)
    assert_rewritten(graph, "ag_matmul")
    (region,) = graph.rewritten
    assert region.summary["dim"] == gather_dim
    assert region.summary["keep_gathered"] is return_a


@pytest.mark.skipif(not FUNCOL_GATHER_DIM_TRACES, reason="funcol gather_dim > 0 graph-breaks before torch 2.13")
@pytest.mark.parametrize("gather_dim", [1, 2])
def test_funcol_gather_dim_form(fake_world, gather_dim):
    a_shard, b = torch.randn(2, 8, 16 if gather_dim == 1 else 8), torch.randn(16, 4)

    def fn(a_shard, b):
        return funcol.all_gather_tensor(a_shard, gather_dim=gather_dim, group=group()) @ b

    graph = only_graph(fn, a_shard, b)
    assert_rewritten(graph, "ag_matmul")
    assert graph.rewritten[0].summary["dim"] == gather_dim


@world_param
def test_one_all_gather_feeding_qkv_is_one_region(fake_world):
    x, wq, wk, wv = torch.randn(8, 4, 16), torch.randn(16, 16), torch.randn(16, 8), torch.randn(16, 8)

    def fn(x, wq, wk, wv):
        full = funcol.all_gather_tensor(x, gather_dim=0, group=group())
        return full @ wq, full @ wk, full @ wv

    graph = only_graph(fn, x, wq, wk, wv)
    assert_rewritten(graph, "ag_matmul")
    assert graph.rewritten[0].summary["weights"] == [[16, 16], [16, 8], [16, 8]]


@world_param
def test_linear_with_bias_is_addmm(fake_world):
    x, w, bias = torch.randn(8, 16), torch.randn(24, 16), torch.randn(24)

    def fn(x, w, bias):
        return F.linear(funcol.all_gather_tensor(x, gather_dim=0, group=group()), w, bias)

    graph = only_graph(fn, x, w, bias)
    assert_rewritten(graph, "ag_matmul")
    assert graph.rewritten[0].summary["bias"] == [True]


@world_param
def test_transposed_rows_into_broadcast_bmm(fake_world):
    # (S/W, B, K) gathered on the sequence dim, moved to (B, S, K): matmul decomposes into
    # permute -> expand -> bmm with the 2-D weight expanded over the batch.
    x, w = torch.randn(8, 2, 16), torch.randn(24, 16)

    def fn(x, w):
        return F.linear(funcol.all_gather_tensor(x, gather_dim=0, group=group()).transpose(0, 1), w)

    assert_rewritten(only_graph(fn, x, w), "ag_matmul")


@world_param
def test_bmm_consumer(fake_world):
    x, w = torch.randn(2, 8, 16), torch.randn(2 * fake_world, 16, 4)

    def fn(x, w):
        return torch.bmm(funcol.all_gather_tensor(x, gather_dim=0, group=group()), w)

    assert_rewritten(only_graph(fn, x, w), "ag_matmul")


def test_gathered_tensor_only_used_as_b_operand_is_left_alone(fake_world):
    x, w = torch.randn(8, 16), torch.randn(4, 8 * fake_world)

    def fn(x, w):
        return w @ funcol.all_gather_tensor(x, gather_dim=0, group=group())

    graph = only_graph(fn, x, w)
    assert not graph.rewritten and graph.collectives_after == {"all_gather": 1}
    assert "no mm/addmm/bmm/_scaled_mm takes the gathered tensor" in graph.skipped[0].reason


# --- matmul -> reduce-scatter / all-reduce -----------------------------------------------------

@world_param
@pytest.mark.parametrize("a_dims,scatter_dim", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
def test_matmul_reduce_scatter_any_scatter_dim(fake_world, a_dims, scatter_dim, reduce_op):
    # async-TP's test_fuse_matmul_reduce_scatter: reduce_scatter(A @ B, "avg", scatter_dim).
    a = torch.randn(64, 32) if a_dims == 2 else torch.randn(2 * fake_world, 64, 32)
    b = torch.randn(32, 16 * fake_world)

    def fn(a, b):
        return funcol.reduce_scatter_tensor(a @ b, reduce_op, scatter_dim=scatter_dim, group=group())

    graph = only_graph(fn, a, b)
    assert_rewritten(graph, "matmul_rs")
    assert graph.rewritten[0].summary["dim"] == scatter_dim
    assert graph.rewritten[0].summary["reduce_op"] == reduce_op


@world_param
@pytest.mark.parametrize("a_dims", [2, 3])
def test_matmul_all_reduce(fake_world, a_dims):
    a, b = torch.randn(*([4] * (a_dims - 2)), 32, 16), torch.randn(16, 8)

    def fn(a, b):
        return funcol.all_reduce(a @ b, "sum", group=group())

    assert_rewritten(only_graph(fn, a, b), "matmul_ar")


def test_partial_product_used_elsewhere_is_left_alone(fake_world):
    a, b = torch.randn(32, 16), torch.randn(16, 8)

    def fn(a, b):
        y = a @ b
        return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group=group()), y.relu()

    graph = only_graph(fn, a, b)
    assert not graph.rewritten and graph.collectives_after == {"reduce_scatter": 1}
    assert "other users" in graph.skipped[0].reason


def test_reduce_scatter_of_non_matmul_is_left_alone(fake_world):
    def fn(a):
        return funcol.reduce_scatter_tensor(a * 2, "sum", scatter_dim=0, group=group())

    graph = only_graph(fn, torch.randn(32, 16))
    assert not graph.rewritten
    assert "not from a matmul" in graph.skipped[0].reason


def test_all_reduce_max_is_left_alone(fake_world):
    def fn(a, b):
        return funcol.all_reduce(a @ b, "max", group=group())

    graph = only_graph(fn, torch.randn(32, 16), torch.randn(16, 8))
    assert not graph.rewritten
    assert "reduce op 'max'" in graph.skipped[0].reason


def test_disabled_pattern_is_not_searched(fake_world):
    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=group()) @ b

    graph = only_graph(fn, torch.randn(8, 16), torch.randn(16, 8), patterns=("matmul_rs",))
    assert not graph.rewritten and graph.collectives_after == {"all_gather": 1}


def test_schedule_is_clamped_to_rows_and_recorded(fake_world):
    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=group()) @ b

    graph = only_graph(fn, torch.randn(2, 16), torch.randn(16, 8), schedule="chunked", chunks=8)
    assert graph.rewritten[0].schedule == "chunked:2"
    assert any("clamped" in n for n in graph.notes)


# --- DTensor sequence parallel (async-TP's test_dtensor_seq_par) -------------------------------

@world_param
def test_dtensor_sequence_parallel_mlp(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (fake_world,))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                   "2": RowwiseParallel(output_layouts=Shard(0))})
    graph = only_graph(mlp, torch.randn(8, 16))
    assert_rewritten(graph, "ag_matmul")
    assert_rewritten(graph, "matmul_rs")
    assert graph.collectives_after == {}


def test_failing_analysis_leaves_the_graph_untouched(fake_world, monkeypatch):
    from torch_commopt.passes import pipeline

    def broken(graph):
        raise KeyError("boom")

    monkeypatch.setattr(pipeline, "FINDERS", (("ag_matmul", lambda g, cfg: broken(g)),))

    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=group()) @ b

    graph = only_graph(fn, torch.randn(8, 16), torch.randn(16, 8))
    assert not graph.rewritten and graph.collectives_after == {"all_gather": 1}
    assert any("analysis failed" in n for n in graph.notes)


# --- the region DAG (explain's plan view) ---------------------------------------------------

@world_param
def test_region_dag_links_regions_through_the_ops_between_them(fake_world):
    """TP+SP MLP then a second one fed by the first one's reduce-scatter directly: the edges
    name the ops in between and need no reshard (S(0) out of the RS, S(0) into the AG)."""
    w = fake_world
    x, w1, w2, w3, w4 = (torch.randn(8, 16), torch.randn(16, 8 * w), torch.randn(8 * w, 16),
                         torch.randn(16, 8 * w), torch.randn(8 * w, 16))

    def fn(x, w1, w2, w3, w4):
        h = torch.relu(all_gather_on(x, 0) @ w1)
        y = funcol.reduce_scatter_tensor(h @ w2, "sum", scatter_dim=0, group=group())
        h2 = all_gather_on(y, 0) @ w3
        return funcol.reduce_scatter_tensor(h2 @ w4, "sum", scatter_dim=0, group=group())

    graph = only_graph(fn, x, w1, w2, w3, w4)
    assert len(graph.rewritten) == 4 and len(graph.edges) == 3, graph.edges
    assert any("via relu" in e and "reshard: none" in e for e in graph.edges), graph.edges
    assert sum("directly; reshard: none" in e for e in graph.edges) == 2, graph.edges
    assert "edge " in str(torch_commopt.explain())


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_chosen_sequential_keeps_the_graph_as_compiled(fake_world, monkeypatch):
    # The rule or the model choosing `sequential` leaves the region's own collective + matmul
    # (no op of ours in between); a user who fixes schedule="sequential" gets the op.
    import torch_commopt.passes.choose as choose
    import torch_commopt.passes.pipeline as pipeline
    from torch_commopt.core.schedule import Schedule

    a, b = torch.randn(64, 32), torch.randn(32, 16 * fake_world)

    def fn(a, b):
        return funcol.reduce_scatter_tensor(a @ b, "sum", 0, group())

    monkeypatch.setattr(choose, "schedule_for", lambda region, config, report, *ahead: Schedule("sequential"))
    graph = only_graph(fn, a, b)
    assert not graph.rewritten and not graph.commopt_ops
    assert [r.status for r in graph.regions] == [pipeline.KEPT]
    assert graph.collectives_after == graph.collectives_before
    monkeypatch.undo()
    assert_rewritten(only_graph(fn, a, b, schedule="sequential"), "matmul_rs")


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_an_edge_through_a_collective_outside_the_regions_is_priced(fake_world):
    """RS -> all-gather -> relu -> matmul -> RS: the gather feeds no matmul directly, so it is
    no region; the edge between the two reductions asks S(0) -> R, an all-gather of the RS
    output's gathered size, priced by the layout algebra."""
    from torch_commopt.reshard.layouts import Replicate, Shard, reshard
    from torch_commopt.tuner.calibration import prior

    w = fake_world
    x, w1, w2 = torch.randn(16, 32), torch.randn(32, 64), torch.randn(64, 32)

    def fn(x, w1, w2):
        y = funcol.reduce_scatter_tensor(x @ w1, "sum", scatter_dim=0, group=group())
        z = torch.relu(all_gather_on(y, 0))
        return funcol.reduce_scatter_tensor(z @ w2, "sum", scatter_dim=0, group=group())

    graph = only_graph(fn, x, w1, w2)
    assert len(graph.rewritten) == 2, graph.regions
    (edge,) = graph.edges
    want = reshard(Shard(0), Replicate(), 16 * 64 * 4, w, prior("cpu", w))
    assert "via" in edge and "relu" in edge and "reshard: all_gather" in edge, edge
    assert f"({want.time * 1e3:.3f} ms, {want.memory / 2**20:.0f} MiB)" in edge, (edge, want)


def test_plan_view_adds_the_edges_reshards_to_the_graph_total():
    from torch_commopt.passes.dag import Edge
    from torch_commopt.reshard.plan import describe_edges

    cands = {"a": [{"schedule": "ce_push:1", "predicted_ms": 1.0}, {"schedule": "sequential", "predicted_ms": 2.0}],
             "b": [{"schedule": "sequential", "predicted_ms": 0.5}]}
    edges = [Edge(0, 1, ("relu",), "all_gather", 0.25, 8.0), Edge(1, 0, (), "none")]
    (line,) = describe_edges(edges, cands, {"a": "ce_push:1", "b": "sequential"})
    assert line == "edges: 2, 1 with a reshard (0.250 ms, 8 MiB at most); graph total 1.750 ms", line
    assert describe_edges(edges, cands, {"a": "autotune:1", "b": "sequential"}) == []  # not yet decided


# --- a tensor-parallel decoder's row-parallel projections at decode size --------------------

@world_param
def test_decode_sized_row_parallel_projections_are_all_reduce_regions(fake_world):
    """One token for each of two sequences (B 2, S 1) through a TP MLP as DTensor emits it
    (Colwise, then Rowwise to Replicate), and gpt-fast's form (the row-parallel product all-reduced
    in place by dist.all_reduce): each is one matmul -> all-reduce region, with rows that do not
    split over the ranks (the low-latency schedules split none).  (A single row is not a matmul
    here: Inductor's CPU decompositions turn a one-row mm into a pointwise product and sum before
    the pass runs, as they do on CUDA under coordinate_descent_tuning; docs/decode.md.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    mesh = init_device_mesh("cpu", (fake_world,))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.no_grad():
        graph = only_graph(mlp, torch.randn(2, 1, 16))
    assert_rewritten(graph, "matmul_ar")
    assert graph.collectives_after == {}

    w = torch.randn(32 // fake_world, 16)

    def gpt_fast_wo(h):
        y = torch.nn.functional.linear(h, w.t())
        dist.all_reduce(y)
        return y

    torch._dynamo.reset()
    with torch.no_grad():
        graph = only_graph(gpt_fast_wo, torch.randn(3, 1, 32 // fake_world))
    assert_rewritten(graph, "matmul_ar")
