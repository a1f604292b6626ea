"""torch_commopt.optimize: only what is named is compiled with commopt; options checked early."""

from __future__ import annotations

import pytest
import torch

import torch_commopt
from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.parametrize("how", ["instance", "function"])
def test_only_the_optimized_module_is_rewritten(how):
    from optimize_programs import only_feed_forward

    for errors, weights, graphs, attention_compiled in run_distributed(only_feed_forward, 2, how):
        assert not attention_compiled and graphs >= 1
        # dim 64, hidden 128, W=2: the feed_forward's local weights are 64x64 (w1/w3 column-,
        # w2 row-sharded), the attention's 32x64 / 64x32: only the former are rewritten.  The
        # instance is compiled with its own input hook (PrepareModuleInput's all-gather), so its
        # w1/w3 gather-matmul is a region too, and so is its backward's reduce-scatter of both
        # products (their weights as one 128x64 operand); the function form compiles the forward
        # alone, where the gather is not.
        want = {(64, 64), (128, 64)} if how == "instance" else {(64, 64)}
        assert weights and set(weights) == want, weights
        bad = [f"{n}: {c:.2e} vs eager {e:.2e}" for n, c, e in errors if not within_tolerance(c, e)]
        assert not bad, bad


def test_a_decorated_module_class_compiles_each_instance():
    from optimize_programs import decorated_class

    for compiled, plain_untouched, ok, graphs in run_distributed(decorated_class, 2):
        assert compiled and plain_untouched and ok and graphs == 1


def test_bad_options_raise_when_optimize_is_called():
    fn = lambda x: x + 1  # noqa: E731
    with pytest.raises(ValueError, match="unknown key"):
        torch_commopt.optimize(fn, chunk=4)
    with pytest.raises(ValueError, match="Config.chunks"):
        torch_commopt.optimize(fn, chunks=0)
    with pytest.raises(ValueError, match="Config.mode"):
        torch_commopt.optimize(mode="fastest")(fn)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        torch_commopt.optimize(42)
    with pytest.raises(TypeError, match="config must be"):
        torch_commopt.optimize(fn, config="model")


@pytest.mark.parametrize("options,name", [
    ({"consistency_timeout_s": float("nan")}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": float("inf")}, "Config.consistency_timeout_s"),
    ({"saved_gather_budget_mib": float("nan")}, "Config.saved_gather_budget_mib"),
    ({"mode": "model", "memory_budget_mib": float("inf")}, "Config.memory_budget_mib"),
    ({"schedule": "sequential:3"}, "Config.schedule"),
    ({"schedule": "chunked:4:"}, "Config.schedule"),
    ({"attention_schedule": "hybrid:2"}, "Config.attention_schedule"),
    ({"extra_inductor_options": {"no_such_option": 1}}, "Config.extra_inductor_options"),
])
def test_non_finite_numbers_and_malformed_strings_raise_at_the_call(options, name, monkeypatch):
    """Checked by optimize itself, before torch.compile is reached (for a module, a function and
    the decorator form alike)."""
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile reached despite a bad option")

    monkeypatch.setattr(torch, "compile", no_compile)
    monkeypatch.setattr(torch.nn.Module, "compile", no_compile)
    for call in (lambda: torch_commopt.optimize(lambda x: x, **options),
                 lambda: torch_commopt.optimize(torch.nn.Linear(2, 2), **options),
                 lambda: torch_commopt.optimize(**options),
                 lambda: torch_commopt.optimize(lambda x: x, config=options)):
        with pytest.raises(ValueError, match=name):
            call()


def test_config_and_options_combine():
    from torch_commopt.optimize import resolve_config

    cfg = resolve_config(torch_commopt.Config(chunks=3), {"schedule": "chunked"})
    assert cfg.chunks == 3 and cfg.schedule == "chunked"
    assert resolve_config({"chunks": 2}, {"chunks": 5}).chunks == 5  # the keyword wins
    compiled = torch_commopt.optimize(lambda x: x * 2, config={"schedule": "sequential"})
    assert compiled._commopt_config.schedule == "sequential"
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))


def test_a_changed_shape_compiles_a_static_graph_of_its_own(fake_world):
    """optimize's dynamic=False: a short batch gets its own static graph, and the usual shape
    keeps running its rewritten one (torch.compile's default would switch every later call to
    a dynamic graph, which commopt leaves alone)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD.group_name
    fn = torch_commopt.optimize(lambda a, b: funcol.all_gather_tensor(a, gather_dim=0, group=group) @ b)
    torch_commopt.reset_explain()
    w = torch.randn(16, 8)
    for rows in (8, 6, 8, 8):
        fn(torch.randn(rows, 16), w)
    graphs = torch_commopt.explain().graphs
    assert len(graphs) == 2 and all(g.rewritten for g in graphs), [g.skipped for g in graphs]
    assert not any("dynamic shape" in s.reason for g in graphs for s in g.skipped)


def test_a_module_parallelized_itself_is_compiled_with_its_hooks():
    """ColwiseParallel on the Linear itself: its all-gather hook and its matmul in one graph
    (ag_matmul forward, matmul_rs backward), state-dict keys unchanged, same numbers as eager."""
    from optimize_programs import self_parallelized_linear

    for kinds, keys, err, optimized in run_distributed(self_parallelized_linear, 2):
        assert kinds == [("forward", ["ag_matmul"]), ("backward", ["matmul_rs"])], kinds
        assert keys == ["weight"] and optimized
        assert err < 1e-5, err


def test_fsdp_managed_modules_keep_module_compile():
    from torch_commopt.optimize import _hooks_to_inline

    lin = torch.nn.Linear(4, 4)
    assert not _hooks_to_inline(lin)  # no hooks: nn.Module.compile as before
    lin.register_forward_pre_hook(lambda m, a: None)
    assert _hooks_to_inline(lin)
    fsdp = type("FSDPLinear", (torch.nn.Linear,), {})(4, 4)
    fsdp.register_forward_pre_hook(lambda m, a: None)
    assert not _hooks_to_inline(fsdp)
