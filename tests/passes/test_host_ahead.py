"""passes/host_ahead.py and the rule's use of it (pipeline._host_ahead, choose.schedule_for): a
band region of a graph whose host runs ahead takes the rule's GPU-time pick, else it is timed
at its first call.  Fake CUDA tensors: no GPU needed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_commopt.passes.pipeline as pipeline
from torch_commopt import report as explain
from torch_commopt.config import Config
from torch_commopt.kernels.matmul.gpu.pick import GEMM_FLOPS_PER_S
from torch_commopt.passes import choose
from torch_commopt.passes.host_ahead import LAUNCH_S, REGION_HOST_S, estimate, host_runs_ahead

aten = torch.ops.aten


def _graph(mms: list[tuple[int, int, int]], pointwise: int = 0, attention: tuple | None = None):
    """A graph of bf16 CUDA matmuls (m, k, n), `pointwise` elementwise nodes and views, and
    optionally one SDPA forward over q / k of shape `attention`; fake values as Dynamo records."""
    g = torch.fx.Graph()
    with FakeTensorMode():
        def node(target, args, value):
            n = g.call_function(target, args)
            n.meta["val"] = value
            return n

        def leaf(name, shape):
            p = g.placeholder(name)
            p.meta["val"] = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
            return p

        out = None
        for i, (m, k, n) in enumerate(mms):
            a, b = leaf(f"a{i}", (m, k)), leaf(f"b{i}", (k, n))
            out = node(aten.mm.default, (a, b), torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
            node(aten.view.default, (out, [m * n]), torch.empty(m * n, device="cuda", dtype=torch.bfloat16))
        for i in range(pointwise):
            x = leaf(f"x{i}", (64,))
            node(aten.mul.Tensor, (x, x), torch.empty(64, device="cuda", dtype=torch.bfloat16))
        if attention is not None:
            q = leaf("q", attention)
            node(aten._scaled_dot_product_flash_attention.default, (q, q, q),
                 (torch.empty(attention, device="cuda", dtype=torch.bfloat16),))
        g.output(out)
    return g


def test_estimate_counts_matmuls_attention_and_launches():
    gpu, host, launches = estimate(_graph([(4096, 4096, 2048)], pointwise=3, attention=(1, 16, 8192, 128)), regions=2)
    mm = 2.0 * 4096 * 4096 * 2048
    attn = 4.0 * 16 * 8192 * 8192 * 128 / 2  # counted as causal: the smaller figure
    assert gpu == pytest.approx((mm + attn) / GEMM_FLOPS_PER_S["bfloat16"])
    assert launches == 1 + 3 + 1  # the mm, three multiplies, the attention; the view is free
    assert host == pytest.approx(launches * LAUNCH_S + 2 * REGION_HOST_S)


def test_the_host_runs_ahead_only_of_enough_gpu_work():
    # a backward-like graph of s38's training step: 6 ms of matmuls, 80 nodes, 4 regions
    big = _graph([(8192, 4096, 14336)] * 4 + [(8192, 4096, 4096)] * 6, pointwise=70)
    ahead, note = host_runs_ahead(big, regions=4)
    assert ahead and "ranked by GPU time" in note
    # the same nodes around short matmuls: the host may fall behind, so the band is timed
    small = _graph([(2048, 1024, 1024)] * 10, pointwise=70)
    ahead, note = host_runs_ahead(small, regions=4)
    assert not ahead and "timed at their first call" in note
    assert not host_runs_ahead(big, regions=0)[0]  # no region: nothing to decide


def _region(graph: torch.fx.Graph, kind: str, a_shape, w_shape, dim=0):
    with FakeTensorMode():
        a = graph.placeholder(f"ra_{kind}")
        a.meta["val"] = torch.empty(a_shape, device="cuda", dtype=torch.bfloat16)
        w = graph.placeholder(f"rw_{kind}")
        w.meta["val"] = torch.empty(w_shape, device="cuda", dtype=torch.bfloat16)
    t_shape = None if kind == "ag_matmul" else [a_shape[0], w_shape[-1]]  # a reduction's product
    return SimpleNamespace(kind=kind, a=a, a_view=None, t_shape=t_shape, dim=dim, group_size=2, group_name="g",
                           dynamic=False, consumers=[SimpleNamespace(weight=w)],
                           collective=SimpleNamespace(name=f"{kind}_0"))


@pytest.mark.parametrize("ahead_graph", [True, False])
def test_band_regions_take_the_gpu_time_pick_where_the_host_runs_ahead(tmp_path, monkeypatch, ahead_graph):
    import torch_commopt.tuner.machine as machine

    monkeypatch.setattr(machine, "device_name", lambda device: "NVIDIA H100 80GB HBM3")  # no GPU here
    mms = [(8192, 4096, 14336)] * 4 + [(8192, 4096, 4096)] * 6 if ahead_graph else [(2048, 1024, 1024)] * 10
    graph = _graph(mms, pointwise=70)
    # the backward's o_proj all-gather (est. 0.2 ms of GEMM: in the band) and a long reduce-scatter
    band_ag = _region(graph, "ag_matmul", [4096, 4096], [4096, 2048])
    long_rs = _region(graph, "matmul_rs", [16384, 4096], [4096, 8192])
    config = Config(cache_dir=str(tmp_path))
    report = explain.GraphReport(graph_id=0, graph_kind="backward", compile_id=None)
    ahead = pipeline._host_ahead(graph, [band_ag, long_rs], config, report)
    assert ahead is ahead_graph and report.notes[-1].startswith("graph: est.")
    sched = choose.schedule_for(band_ag, config, report, ahead)
    if ahead_graph:
        assert str(sched) == "ce_push:1:par=1" and "ranked by GPU time" in report.notes[-1]
    else:
        assert sched.name == "autotune" and "timed at the first call" in report.notes[-1]
    assert str(choose.schedule_for(long_rs, config, report, ahead)) == "ce_pull:2"  # outside the band


def test_only_the_rule_on_eager_calls_asks(tmp_path):
    graph = _graph([(8192, 4096, 14336)] * 4, pointwise=10)
    regions = [_region(graph, "ag_matmul", [4096, 4096], [4096, 2048])]
    report = explain.GraphReport(graph_id=0, graph_kind="backward", compile_id=None)
    for config in (Config(mode="model"), Config(cuda_graphs=True), Config(schedule="ce_push"),
                   Config(band_in_graph=False)):
        assert not pipeline._host_ahead(graph, regions, config, report)
    long_only = [_region(graph, "matmul_rs", [16384, 4096], [4096, 8192])]
    assert not pipeline._host_ahead(graph, long_only, Config(cache_dir=str(tmp_path)), report)
    assert report.notes == []  # no band region, nothing to note
    assert pipeline._host_ahead(graph, regions, Config(cache_dir=str(tmp_path)), report)


def _forward_of_llama8b_tp2(pointwise: int = 38):
    """A training forward graph at a Llama-3-8B layer's TP shapes (TP 2, 8192 tokens, dim 4096, 16 / 4
    local heads, hidden 7168 a rank): est. ~2.6 ms of matmuls and attention against 43
    launches and 4 regions of host -- not ahead alone."""
    mms = [(8192, 4096, 3072), (8192, 2048, 4096), (8192, 4096, 7168), (8192, 4096, 7168), (8192, 7168, 4096)]
    return _graph(mms, pointwise=pointwise, attention=(1, 16, 8192, 128))


def test_a_training_forward_counted_with_its_backward():
    from torch_commopt.passes.host_ahead import ATTENTION_BWD, BWD_LAUNCHES, BWD_MATMUL

    graph = _forward_of_llama8b_tp2()
    gpu, host, launches = estimate(graph, regions=4)
    assert not host_runs_ahead(graph, regions=4)[0]  # 43 launches + 4 regions of host > the GPU's work
    gpu2, host2, launches2 = estimate(graph, regions=4, with_backward=True)
    attn = 4.0 * 16 * 8192 * 8192 * 128 / 2 / GEMM_FLOPS_PER_S["bfloat16"]
    assert gpu2 == pytest.approx(gpu + BWD_MATMUL * (gpu - attn) + ATTENTION_BWD * attn)
    assert host2 == pytest.approx(host + BWD_LAUNCHES * launches * LAUNCH_S + 4 * REGION_HOST_S)
    assert launches2 == launches + math.ceil(BWD_LAUNCHES * launches)
    ahead, note = host_runs_ahead(graph, regions=4, with_backward=True)
    assert ahead and note.startswith("graph and the backward it implies") and "4 regions each way" in note
    # a forward whose own host dwarfs its GPU work stays timed even with its backward counted
    thin = _graph([(2048, 1024, 1024)] * 10, pointwise=70)
    assert not host_runs_ahead(thin, regions=4, with_backward=True)[0]


@pytest.mark.parametrize("kind", ["forward", "backward", "inference"])
def test_band_in_graph_training_counts_only_a_training_forward_with_its_backward(kind):
    graph = _forward_of_llama8b_tp2()
    # q/k/v's and w1/w3's all-gathers (in the band), o's and w2's reduce-scatters
    regions = [_region(graph, "ag_matmul", [4096, 4096], [4096, 2048]) for _ in range(2)]
    regions += [_region(graph, "matmul_rs", [8192, 2048], [2048, 4096]) for _ in range(2)]
    for setting, expect in ((True, False), ("training", kind == "forward")):
        report = explain.GraphReport(graph_id=0, graph_kind=kind, compile_id=None)
        assert pipeline._host_ahead(graph, regions, Config(band_in_graph=setting), report) is expect
        assert report.notes[-1].startswith("graph and the backward" if expect else "graph: est.")


@pytest.mark.parametrize("bad", [1, 0, None, "train", "forward"])
def test_band_in_graph_takes_a_bool_or_training(bad):
    with pytest.raises(ValueError, match="band_in_graph"):
        Config(band_in_graph=bad)
    assert Config(band_in_graph="training").band_in_graph == "training"


def test_host_bound_graphs_inductor_leaves_only_a_host_bound_graph_to_inductor():
    # s42's forward (host est. above its GPU work) and a backward-sized graph (the GPU's ahead)
    forward = _forward_of_llama8b_tp2()
    regions = [_region(forward, "ag_matmul", [4096, 4096], [4096, 2048]) for _ in range(2)]
    regions += [_region(forward, "matmul_rs", [8192, 2048], [2048, 4096]) for _ in range(2)]
    report = explain.GraphReport(graph_id=0, graph_kind="forward", compile_id=None)
    assert not pipeline._left_host_bound(forward, regions, Config(), report)  # default "overlap"
    assert report.notes == []
    assert pipeline._left_host_bound(forward, regions, Config(host_bound_graphs="inductor"), report)
    assert "host-bound, left to Inductor" in report.notes[-1] and "4 regions" in report.notes[-1]
    big = _graph([(8192, 4096, 14336)] * 4 + [(8192, 4096, 4096)] * 6, pointwise=70)
    big_regions = [_region(big, "matmul_rs", [16384, 4096], [4096, 8192])]
    assert not pipeline._left_host_bound(big, big_regions, Config(host_bound_graphs="inductor"), report)
    # only the rule's eager CUDA programs: a fixed schedule, a mode, CUDA graphs or a dynamic region keep theirs
    for config in (Config(host_bound_graphs="inductor", schedule="ce_push"),
                   Config(host_bound_graphs="inductor", mode="model"),
                   Config(host_bound_graphs="inductor", cuda_graphs=True)):
        assert not pipeline._left_host_bound(forward, regions, config, report)
    dynamic = [SimpleNamespace(**{**vars(regions[0]), "dynamic": True})]
    assert not pipeline._left_host_bound(forward, dynamic, Config(host_bound_graphs="inductor"), report)


@pytest.mark.parametrize("bad", [True, "nccl", None, "Inductor"])
def test_host_bound_graphs_takes_overlap_or_inductor(bad):
    with pytest.raises(ValueError, match="host_bound_graphs"):
        Config(host_bound_graphs=bad)
