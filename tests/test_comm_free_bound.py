"""benchmarks/comm_free.py, bench_e2e's comm-free bound: every functional collective leaves the
graph (a gather reads a constant of its shape, a reduce-scatter keeps its first rows, an
all-reduce and a wait pass their input on), and the stripped graph runs with no process group."""

import pytest
import torch
import torch.fx

from benchmarks import comm_free

funcol = torch.ops._c10d_functional


def _program(x, w):
    g = funcol.wait_tensor.default(funcol.all_gather_into_tensor.default(x, 2, "tp"))
    y = torch.ops.aten.mm.default(g, w)
    r = funcol.wait_tensor.default(funcol.reduce_scatter_tensor.default(y, "sum", 2, "tp"))
    a = funcol.wait_tensor.default(funcol.all_reduce.default(r, "sum", "tp"))
    return torch.ops.aten.add.Tensor(a, 1.0)


def _traced():
    gm = torch.fx.symbolic_trace(_program)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    vals = {"x": x, "w": w}
    for node in gm.graph.nodes:  # meta["val"] as Inductor's post-grad graphs carry it (real tensors here)
        if node.op == "placeholder":
            node.meta["val"] = vals[node.name]
        elif node.op == "call_function":
            if node.target is funcol.all_gather_into_tensor.default:
                node.meta["val"] = torch.empty(8, 3)
            elif node.target is funcol.reduce_scatter_tensor.default:
                node.meta["val"] = torch.empty(4, 5)
            elif node.target is torch.ops.aten.mm.default:
                node.meta["val"] = torch.empty(8, 5)
    return gm, x, w


def test_every_collective_leaves_and_the_graph_runs_without_a_process_group():
    gm, x, w = _traced()
    before = dict(comm_free.stats())
    comm_free.strip_collectives(gm.graph)
    gm.recompile()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert not any("_c10d_functional" in t for t in targets), targets
    got = {k: v - before.get(k, 0) for k, v in comm_free.stats().items() if k != "graphs"}
    assert got == {"replaced all_gather_into_tensor": 1, "replaced reduce_scatter_tensor": 1,
                   "replaced all_reduce": 1, "replaced wait_tensor": 3}
    out = gm(x, w)  # no process group exists here: a collective left would fail
    gathered = next(getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr")
    assert gathered.shape == (8, 3) and gathered.std() > 0.5  # random data of the gather's shape, not zeros
    assert torch.equal(out, (gathered @ w)[:4] + 1.0)


def test_an_unknown_collective_is_left_and_counted():
    def prog(x):
        return funcol.wait_tensor.default(funcol.all_to_all_single.default(x, [2, 2], [2, 2], "tp"))

    gm = torch.fx.symbolic_trace(prog)
    comm_free.strip_collectives(gm.graph)
    assert any("all_to_all_single" in str(n.target) for n in gm.graph.nodes)
    assert comm_free.stats().get("left _c10d_functional.all_to_all_single.default", 0) >= 1
    assert not comm_free.valid({"replaced wait_tensor": 1, "left x": 1}) and not comm_free.valid({"graphs": 2})
    assert comm_free.valid({"graphs": 2, "replaced all_gather_into_tensor": 1})


def test_the_pass_is_installed_only_inside_its_context():
    import torch._functorch.config as fcfg
    import torch._inductor.config as cfg

    def state():
        return cfg.post_grad_custom_post_pass, cfg.fx_graph_cache, fcfg.enable_autograd_cache

    before = state()
    with comm_free.installed():
        assert state() == (comm_free.PASS, False, False) and comm_free.PASS.uuid()
    assert state() == before
    with pytest.raises(KeyError), comm_free.installed():
        raise KeyError("restored on errors too")
    assert state() == before


def test_its_compile_options_are_accepted_and_differ_from_plain_inductor():
    """torch.compile takes the options (type-checked there), and the wrapper they make is not
    equal to plain Inductor's: Dynamo may not hand the bound the inductor variant's entries."""
    plain = torch._TorchCompileInductorWrapper("default", None, False)
    bound = torch._TorchCompileInductorWrapper("default", comm_free.OPTIONS, False)
    assert bound.config["post_grad_custom_post_pass"] is comm_free.PASS and bound != plain


def test_the_sync_only_variant_meets_where_each_collective_was_and_moves_nothing(fake_world):
    import torch.distributed as dist

    group = dist.group.WORLD.group_name

    def program(x, w):
        g = funcol.wait_tensor.default(funcol.all_gather_into_tensor.default(x, 2, group))
        y = torch.ops.aten.mm.default(g, w)
        r = funcol.wait_tensor.default(funcol.reduce_scatter_tensor.default(y, "sum", 2, group))
        return torch.ops.aten.add.Tensor(r, 1.0)

    gm = torch.fx.symbolic_trace(program)
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    vals = {"x": x, "w": w}
    for node in gm.graph.nodes:  # every node's meta["val"], as in Inductor's post-grad graphs
        if node.op == "placeholder":
            node.meta["val"] = vals[node.name]
        elif node.op == "call_function":
            node.meta["val"] = {funcol.all_gather_into_tensor.default: torch.empty(8, 3),
                                torch.ops.aten.mm.default: torch.empty(8, 5),
                                funcol.reduce_scatter_tensor.default: torch.empty(4, 5)}.get(node.target)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta["val"] is None:
            node.meta["val"] = node.args[0].meta["val"]
    before = dict(comm_free.stats(sync=True))
    comm_free.strip_collectives(gm.graph, sync=True)
    gm.recompile()
    got = {k: v - before.get(k, 0) for k, v in comm_free.stats(sync=True).items() if k != "graphs"}
    assert got == {"synced all_gather_into_tensor": 1, "synced reduce_scatter_tensor": 1,
                   "replaced all_gather_into_tensor": 1, "replaced reduce_scatter_tensor": 1,
                   "replaced wait_tensor": 2}
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    names = [str(n.target).split(".")[-2] for n in calls]
    # a one-element all-reduce and its wait before the (constant) gathered rows' reader, and again
    # before the product's first rows are read: the collectives' places, in order
    assert names == ["as_strided", "all_reduce", "wait_tensor", "mm", "as_strided", "all_reduce", "wait_tensor",
                     "slice", "add"], names
    assert all(list(n.meta["val"].shape) == [1] for n in calls if "all_reduce" in str(n.target))
    assert comm_free.stats().get("synced all_gather_into_tensor") is None  # the bound's counts stay apart
    out = gm(x, w)  # runs on the fake process group: only the one-element all-reduces communicate
    gathered = next(getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr")
    assert torch.equal(out, (gathered @ w)[:4] + 1.0)
