"""The expert-parallel cost model (tuner/moe/cost.py): what it picks at its ends, on the H200 priors."""

from __future__ import annotations

import dataclasses

import pytest

from torch_commopt.tuner.calibration import prior
from torch_commopt.tuner.moe.cost import CHUNK_OVERHEAD, MoEShape, best, estimates

DSV2_8K = MoEShape(rows=49152, dim=2048, hidden=1408, local_experts=32, world=2, dtype="bfloat16", transport="ce")


def test_on_nvlink_h200s_the_plain_exchange_wins_at_the_measured_shapes():
    # 2x H200 (benchmarks/results/moe_h200x2_*): by_expert ran 0.79-0.99x of a2a at every case, its
    # own compute 1.06-1.7x the grouped GEMMs' while torchtitan exposed 6-32% of its step in the exchange
    cal = prior("NVIDIA H200", 2)
    for hidden, experts in ((1408, 32), (768, 64), (14336, 4)):
        for rows in (4096 * 6, 8192 * 6, 16384 * 6):
            shape = dataclasses.replace(DSV2_8K, rows=rows, hidden=hidden, local_experts=experts)
            assert best(shape, cal)[0] == "a2a", shape


def test_a_slow_link_beside_the_experts_is_pipelined():
    # a link ten times slower (PCIe-like): the exchange outweighs by_expert's own compute
    cal = prior("NVIDIA H200", 2)
    slow = dataclasses.replace(cal.p2p, bytes_per_s=cal.p2p.bytes_per_s / 10)
    cal = dataclasses.replace(cal, p2p=slow)
    pick, est = best(DSV2_8K, cal)
    assert pick.startswith("by_expert:") and est[pick] < est["a2a"]
    # what a2a exposes is hidden but for the first chunk's dispatch and the last one's combine
    # (1/C of it each way), less by_expert's extra compute
    exposed = est["a2a"] - estimates(dataclasses.replace(DSV2_8K, world=1), cal)["a2a"]
    assert 0.2 * exposed < est["a2a"] - est[pick] < (1 - 1 / int(pick.split(":")[1])) * exposed


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
