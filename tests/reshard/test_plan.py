"""Whole-graph choice under Config.memory_budget_mib (reshard.plan) and its use by the pass."""

from __future__ import annotations

import itertools
import random

import pytest

from torch_commopt import Config
from torch_commopt.reshard.plan import choose_within_budget, footprint, least_memory_plan
from torch_commopt.testing.launch import run_distributed
from torch_commopt.tuner.calibration import prior
from torch_commopt.tuner.matmul.model import RegionShape, rank


def _rows(shape):
    return [{"schedule": str(p.schedule), "predicted_ms": p.seconds * 1e3, "extra_mib": p.extra_bytes / 2**20,
             "pool_mib": p.pool_bytes / 2**20} for p in rank(shape, prior("NVIDIA H200", 2))]


def test_regions_whose_buffers_share_a_size_class_hold_it_once():
    big = _rows(RegionShape("ag_matmul", 8192, 8192, (14336,), 2, "bfloat16"))
    small = _rows(RegionShape("ag_matmul", 8192, 8192, (2048,), 2, "bfloat16"))
    short = _rows(RegionShape("ag_matmul", 1024, 8192, (8192,), 2, "bfloat16"))
    gathered = 2 * 8192 * 8192 * 2 / 2**20  # MiB of one gathered input (sequential's, for one call)
    buffer = 2 * gathered  # both regions' symmetric request: one 512 MiB class
    free, _ = choose_within_budget({"big": big, "small": small}, 1e9)
    assert big[free["big"]]["pool_mib"] == small[free["small"]]["pool_mib"] == buffer  # both GPU
    assert footprint({"big": big, "small": small}, free) == buffer  # one buffer, not two
    choice, note = choose_within_budget({"big": big, "small": small}, buffer)
    assert choice == free and "plan within" in note
    # a budget under the class: both keep NCCL, each holding its gathered input for one call
    choice, note = choose_within_budget({"big": big, "small": small}, buffer - 1)
    assert all(rows[choice[n]]["pool_mib"] == 0 for n, rows in (("big", big), ("small", small)))
    assert footprint({"big": big, "small": small}, choice) == gathered
    # a third region in a smaller class gets the copy engine only where both classes fit
    three = {"big": big, "small": small, "short": short}
    choice, _ = choose_within_budget(three, buffer + gathered / 8)
    assert short[choice["short"]]["pool_mib"] == 0 and big[choice["big"]]["pool_mib"] == buffer
    choice, _ = choose_within_budget(three, buffer + buffer / 8)
    assert short[choice["short"]]["pool_mib"] > 0
    choice, note = choose_within_budget({"big": big, "small": small}, 1.0)
    assert "no plan fits" in note and all(rows[choice[n]]["extra_mib"] == gathered
                                          for n, rows in (("big", big), ("small", small)))


def _brute(cands, key, budget):
    names = list(cands)
    plans = [dict(zip(names, c)) for c in itertools.product(*(range(len(cands[n])) for n in names))]
    fits = [p for p in plans if footprint(cands, p) <= budget]
    rank = lambda p: (sum(cands[n][i][key] for n, i in p.items()), footprint(cands, p))  # noqa: E731
    return min(map(rank, fits)) if fits else None, min(footprint(cands, p) for p in plans)


def test_the_budgeted_plan_is_the_brute_force_optimum_of_the_shared_buffer_count():
    rng = random.Random(5)
    for _ in range(300):
        cands = {}
        for r in range(rng.randint(1, 5)):
            rows = []
            for j in range(rng.randint(1, 4)):
                pool = rng.choice([0, 0, 16, 40, 64, 100, 128, 256])
                rows.append({"schedule": f"s{j}", "predicted_ms": rng.uniform(0.5, 2.0),
                             "pool_mib": pool, "extra_mib": pool + rng.choice([0, 8, 32, 64])})
            cands[f"r{r}"] = rows
        budget = rng.uniform(0, 500)
        want, least = _brute(cands, "predicted_ms", budget)
        choice, note = choose_within_budget(cands, budget)
        got = (sum(cands[n][i]["predicted_ms"] for n, i in choice.items()), footprint(cands, choice))
        if want is None:
            assert "no plan fits" in note and got[1] == pytest.approx(least)
        else:
            assert got[0] == pytest.approx(want[0]) and got[1] <= budget, (got, want)
        assert footprint(cands, least_memory_plan(cands)) == pytest.approx(least)


def test_budget_options_are_validated():
    with pytest.raises(ValueError, match="memory_budget_mib"):
        Config(mode="model", memory_budget_mib=-1)
    with pytest.raises(ValueError, match="only mode='model'"):
        Config(memory_budget_mib=100)
    Config(mode="model", memory_budget_mib=0)


def _compile_with_budget(rank_: int, world: int, budget):
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import torch_commopt

    torch.manual_seed(rank_)
    a, b, c = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48, 16)

    def fn(a, b, c):
        h = funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD) @ b
        return funcol.reduce_scatter_tensor(torch.relu(h) @ c, "sum", scatter_dim=0, group=dist.group.WORLD)

    torch_commopt.reset_explain()
    got = torch.compile(fn, backend="commopt", options={"mode": "model", "memory_budget_mib": budget})(a, b, c)
    want = fn(a, b, c)
    (graph,) = torch_commopt.explain().graphs
    return list(graph.notes) + list(graph.plan), float((got - want).norm() / want.norm())


def test_the_pass_plans_within_the_budget_on_gloo():
    for budget, expected in ((1e6, "plan within"), (0.0, "no plan fits")):
        for notes, err in run_distributed(_compile_with_budget, 2, budget, timeout_s=300):
            assert err < 1e-5 and any(expected in n for n in notes), notes
            assert any(n.startswith("2 region(s), predicted") for n in notes), notes
            assert any(n.startswith("runner-up:") for n in notes), notes


def test_plan_view_totals_and_runner_up():
    from torch_commopt.reshard.plan import describe_plan

    # buffers: ag 64 MiB, rs 16 MiB (two classes); rs ce_push:2 also stages 16 MiB per call
    cands = {"ag": [{"schedule": "ce_push:1", "predicted_ms": 1.0, "extra_mib": 64, "pool_mib": 64},
                    {"schedule": "sequential", "predicted_ms": 1.5, "extra_mib": 0}],
             "rs": [{"schedule": "ce_push:2", "predicted_ms": 2.0, "extra_mib": 32, "pool_mib": 16},
                    {"schedule": "direct:1", "predicted_ms": 2.1, "extra_mib": 16, "pool_mib": 16}]}
    lines = describe_plan(cands, {"ag": "ce_push:1", "rs": "ce_push:2"}, None)
    assert lines[0] == "2 region(s), predicted 3.000 ms, 96 MiB extra"
    assert lines[1] == "runner-up: rs direct:1: predicted 3.100 ms (+0.100), 80 MiB extra"
    # a chosen schedule that is not among the ranked candidates (an autotune placeholder): no view
    assert describe_plan(cands, {"ag": "autotune:1:id=x", "rs": "ce_push:2"}, None) == []


def _gpu_rows(shape):
    return [{"schedule": str(p.schedule), "predicted_ms": p.seconds * 1e3, "extra_mib": p.extra_bytes / 2**20,
             "pool_mib": p.pool_bytes / 2**20, "gpu_ms": p.gpu_s * 1e3, "host_ms": p.host_s * 1e3}
            for p in rank(shape, prior("NVIDIA H200", 2))]


def test_graph_plan_weighs_summed_device_time_while_the_host_runs_ahead():
    from torch_commopt.reshard.plan import choose_for_graph

    # Short reductions: alone, a GPU schedule is host-bound and sequential-like choices rank first
    short = {f"rs{i}": _gpu_rows(RegionShape("matmul_rs", 8192, 2048, (4096,), 2, "bfloat16")) for i in range(2)}
    alone = {n: min(range(len(rows)), key=lambda i: rows[i]["predicted_ms"]) for n, rows in short.items()}
    choice, note, key = choose_for_graph(short, None)
    gpu = {n: min(range(len(rows)), key=lambda i: rows[i]["gpu_ms"]) for n, rows in short.items()}
    host = sum(short[n][i]["host_ms"] for n, i in gpu.items())
    total = sum(short[n][i]["gpu_ms"] for n, i in gpu.items())
    if host <= total:
        assert key == "gpu_ms" and choice == gpu and "device time" in note
    else:
        assert key == "predicted_ms" and choice == alone and "host-bound" in note
    # a graph whose host work exceeds its device work is planned per region
    bound = {n: [dict(r, host_ms=r["gpu_ms"] * 10) for r in rows] for n, rows in short.items()}
    choice, note, key = choose_for_graph(bound, None)
    assert key == "predicted_ms" and choice == alone and "host-bound" in note
    # and one where the host is cheap picks by device time even where a region alone is host-bound
    cheap = {n: [dict(r, host_ms=r["gpu_ms"] / 10, predicted_ms=r["gpu_ms"] + (1.0 if "ce_push" in r["schedule"] else 0))
                 for r in rows] for n, rows in short.items()}
    choice, note, key = choose_for_graph(cheap, None)
    assert key == "gpu_ms" and choice == gpu
    # rows without device/host times (CPU calibration): per-region times
    plain = {n: [{k: v for k, v in r.items() if k not in ("gpu_ms", "host_ms")} for r in rows] for n, rows in short.items()}
    assert choose_for_graph(plain, None)[2] == "predicted_ms"


def test_graph_plan_respects_the_budget():
    from torch_commopt.reshard.plan import choose_for_graph

    big = _gpu_rows(RegionShape("ag_matmul", 8192, 8192, (14336,), 2, "bfloat16"))
    small = _gpu_rows(RegionShape("ag_matmul", 8192, 8192, (2048,), 2, "bfloat16"))
    gathered = 2 * 8192 * 8192 * 2 / 2**20
    choice, note, _ = choose_for_graph({"big": big, "small": small}, 3 * gathered)
    assert footprint({"big": big, "small": small}, choice) <= 3 * gathered
    assert "plan within" in note
