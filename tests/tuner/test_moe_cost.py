"""The expert-parallel cost model (tuner/moe/cost.py): what it picks at its ends, on the H200 priors."""

from __future__ import annotations

import dataclasses

import pytest

from torch_commopt.tuner.calibration import prior
from torch_commopt.tuner.moe import cost
from torch_commopt.tuner.moe.cost import CHUNK_OVERHEAD, MIN_PIPELINED_S, MoEShape, best, estimates

DSV2_8K = MoEShape(rows=49152, dim=2048, hidden=1408, local_experts=32, world=2, dtype="bfloat16", transport="ce")


@pytest.mark.parametrize("hidden,experts,top_k,tokens,want", [
    (1408, 32, 6, 8192, "by_expert"), (1408, 32, 6, 16384, "by_expert"),  # DeepSeek-V2-Lite-like
    (768, 64, 8, 8192, "by_expert"), (768, 64, 8, 16384, "by_expert"),  # Qwen3-30B-A3B-like
    (14336, 4, 2, 4096, "a2a"), (14336, 4, 2, 16384, "by_expert"),  # Mixtral-like
    (1408, 32, 6, 4096, "a2a"), (768, 64, 8, 4096, "a2a")])  # 4K tokens: by_expert's host work exposed
def test_on_nvlink_h200s_the_picks_follow_the_measured_differences(hidden, experts, top_k, tokens, want):
    # 2x H200, EP=2 (benchmarks/results/moe_h200x2_*): by_expert ran 3.5-9% faster than a2a on the
    # fine-grained layers, the Mixtral-like one 3.4% slower at 4K tokens a rank (its two chunks'
    # GEMMs of 4096 rows 6.8% slower than whole) and 1.5% faster at 16K
    cal = prior("NVIDIA H200", 2)
    rows = 1 << (tokens * top_k - 1).bit_length()  # the chooser asks about the peak rounded up to a power of two
    shape = dataclasses.replace(DSV2_8K, rows=rows, hidden=hidden, local_experts=experts, dim=4096 if experts == 4 else 2048)
    assert best(shape, cal)[0].split(":")[0] == want


def test_a_slow_link_beside_the_experts_is_pipelined(monkeypatch):
    # links ten times slower (PCIe-like), the copy engine's and NCCL's: the exchange outweighs
    # by_expert's extra copies
    cal = prior("NVIDIA H200", 2)
    slow = dataclasses.replace(cal.p2p, bytes_per_s=cal.p2p.bytes_per_s / 10)
    nccl = cal.collective["all_gather"]
    cal = dataclasses.replace(cal, p2p=slow, collective={**cal.collective, "all_gather": dataclasses.replace(
        nccl, bytes_per_s=nccl.bytes_per_s / 10)})
    pick, est = best(DSV2_8K, cal)
    assert pick.startswith("by_expert:") and est[pick] < est["a2a"]
    # what stays exposed is the first chunk's dispatch and the last one's combine: more than
    # nothing, less than a2a's whole exchange
    monkeypatch.setattr(cost, "MIN_PIPELINED_S", 0.0)  # priced with no exchange at all: a short call
    alone = estimates(dataclasses.replace(DSV2_8K, world=1), cal)
    assert alone[pick] < est[pick] < est["a2a"]
    chunks = int(pick.split(":")[1])
    assert est[pick] - alone[pick] > 2 * cal.p2p.time(DSV2_8K.rows * DSV2_8K.dim * 2 / 2 / DSV2_8K.local_experts)
    assert chunks in CHUNK_OVERHEAD


def test_with_no_overlap_at_all_the_plain_exchange_wins():
    cal = dataclasses.replace(prior("NVIDIA H200", 2), collective_overlap_slowdown=1.0)
    pick, est = best(dataclasses.replace(DSV2_8K, transport="nccl"), cal)
    assert pick == "a2a" and all(v > est["a2a"] for k, v in est.items() if k != "a2a")


def test_tiny_calls_keep_the_plain_exchange_and_chunks_never_exceed_the_experts():
    cal = prior("NVIDIA H200", 2)
    assert best(dataclasses.replace(DSV2_8K, rows=64, dim=64, hidden=64), cal)[0] == "a2a"
    est = estimates(dataclasses.replace(DSV2_8K, local_experts=2), cal)
    assert set(est) == {"a2a", "by_expert:2"} and set(CHUNK_OVERHEAD) == {2, 4, 6}


@pytest.mark.parametrize("transport", ["ce", "nccl"])
def test_estimates_grow_with_the_rows(transport):
    cal = prior("NVIDIA H200", 2)
    small = estimates(dataclasses.replace(DSV2_8K, rows=8192, transport=transport), cal)
    large = estimates(dataclasses.replace(DSV2_8K, transport=transport), cal)
    assert all(large[k] > small[k] for k in small)


def test_a_calibration_without_a_local_copy_prices_no_copies():
    # a CPU's calibration has no local copy link: the estimates still come (as gloo runs them)
    cal = dataclasses.replace(prior("NVIDIA H200", 2), local_copy=None)
    est = estimates(DSV2_8K, cal)
    assert set(est) >= {"a2a", "by_expert:2"} and all(v > 0 for v in est.values())


def test_a_short_call_keeps_the_plain_exchange_whatever_the_pipeline_would_hide(monkeypatch):
    # 4K tokens a rank on the DeepSeek-V2-Lite-like layer: the GPU estimate favours by_expert, but
    # the call is short enough that by_expert's host work sets the pace (1.4-1.5 ms more than a2a's
    # on 2x H200, where it ran 0.99x torchtitan's EP and a2a 1.17x)
    cal = prior("NVIDIA H200", 2)
    short = dataclasses.replace(DSV2_8K, rows=32768)
    est = estimates(short, cal)
    assert est == {"a2a": est["a2a"]} and est["a2a"] < MIN_PIPELINED_S
    monkeypatch.setattr(cost, "MIN_PIPELINED_S", 0.0)  # the floor lifted, by_expert would be picked
    assert best(short, cal)[0].startswith("by_expert")


def test_the_chooser_asks_the_group_once_per_shape_and_answers_later_calls_itself(monkeypatch):
    """Every MoE call asks its chooser, right after the counts' host read while the GPU waits: a
    shape seen before is answered from a key cheap to build, without a new question to the group."""
    import types

    import torch

    from torch_commopt.kernels.moe.exchange import Routing
    from torch_commopt.tuner.moe import choose

    asked = []
    monkeypatch.setattr(choose, "calibration_for", lambda *a: prior("NVIDIA H200", 2))
    monkeypatch.setattr(choose, "decide", lambda group, question, answer, timeout: asked.append(question) or answer())
    pick = choose.chooser(5.0)
    group = types.SimpleNamespace(group_name="ep", size=lambda: 2)
    x = torch.zeros(8, 2048)
    weights = (torch.zeros(32, 1408, 2048),)
    routing = Routing(0, 2, ((1,) * 32, (1,) * 32), ((1,) * 32, (1,) * 32), peak=49152)
    first = pick(routing, x, weights, group)
    assert pick(routing, x, weights, group) == first and len(asked) == 1
    assert pick(dataclasses.replace(routing, peak=40000), x, weights, group) == first and len(asked) == 1  # same pow2
    pick(dataclasses.replace(routing, peak=4096), x, weights, group)
    assert len(asked) == 2 and asked[1]["rows"] == 4096


def _capacity(shape: MoEShape, joined: float = 0.0, slower: float = 1.0):
    """capacity_estimates for a SwiGLU's forward over `shape` on the H200 priors (NCCL's link
    `slower` times slower)."""
    cal = prior("NVIDIA H200", 2)
    nccl = cal.collective["all_gather"]
    cal = dataclasses.replace(cal, collective={**cal.collective, "all_gather": dataclasses.replace(
        nccl, bytes_per_s=nccl.bytes_per_s / slower)})
    fit = cal.gemm["bfloat16"]
    r, d, h = shape.rows, shape.dim, shape.hidden
    gemm = 2 * fit.time(r, h, d) + fit.time(r, d, h)
    return cost.capacity_estimates(dataclasses.replace(shape, transport="nccl"), cal, gemm, joined, ops=17)


def test_capacity_chunks_on_nccl_are_kept_out_where_nccl_slows_the_gemms_beside_it(monkeypatch):
    # the H200 priors: NCCL's all-to-all kernels beside the GEMMs slow them by 0.8 of the overlap
    # (collective_overlap_slowdown), so the chunks' copies are not won back on any link; where a
    # collective overlaps well (slowdown 0.1) and the link is slow, they are; a tiny call never
    nvlink = _capacity(DSV2_8K)
    assert min(nvlink, key=nvlink.get) == "a2a"
    real = prior("NVIDIA H200", 2)
    monkeypatch.setattr(cost, "_link", lambda shape, cal: (cal.collective["all_gather"], 0.1))
    slow = _capacity(DSV2_8K, slower=10)
    assert min(slow, key=slow.get).startswith("by_expert:") and min(slow.values()) < slow["a2a"]
    tiny = _capacity(dataclasses.replace(DSV2_8K, rows=512, dim=256, hidden=256), slower=10)
    assert min(tiny, key=tiny.get) == "a2a"
    assert real.collective_overlap_slowdown == 0.8  # what the first reading rests on


def test_capacity_joins_cost_the_chunks_and_only_them():
    free, joined = _capacity(DSV2_8K), _capacity(DSV2_8K, joined=4 * DSV2_8K.rows * DSV2_8K.dim * 2)
    assert joined["a2a"] == free["a2a"]
    assert all(joined[k] > free[k] for k in free if k != "a2a")
    few = _capacity(dataclasses.replace(DSV2_8K, local_experts=2))
    assert set(few) == {"a2a", "by_expert:2"}  # no more chunks than local experts
