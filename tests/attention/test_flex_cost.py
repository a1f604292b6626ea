"""The FlexAttention schedules' cost model (tuner/attention/flex_cost.py): pure arithmetic."""

import math

import pytest

from torch_commopt.tuner.attention.cost import CPMachine
from torch_commopt.tuner.attention.flex_cost import (
    RING_BLOCK_RATE,
    causal_work,
    flex_candidates,
    flex_estimate_ms,
    rank_flex_schedules,
    segment_work,
    ulysses_ms,
)

SHAPE = (1, 32, 8, 32768, 128)


def test_a_causal_masks_work_falls_most_on_the_last_rank():
    work = causal_work(4)
    assert [sum(row) for row in work] == [0.5, 1.5, 2.5, 3.5]
    assert work[2] == [1.0, 1.0, 0.5, 0.0]


def test_with_free_links_the_busiest_ranks_compute_decides():
    m = CPMachine(link_bytes_per_s=1e30, alpha_s=0.0, flops_per_s=400e12, launch_s=0.0)
    block_ms = 4 * 32 * (32768 // 2) ** 2 * 128 / 400e12 * 1e3
    work = causal_work(2)
    assert flex_estimate_ms("allgather", SHAPE, work, dtype="bfloat16", machine=m) == pytest.approx(1.5 * block_ms)
    assert flex_estimate_ms("ring", SHAPE, work, dtype="bfloat16", machine=m) == pytest.approx(1.5 * block_ms /
                                                                                               RING_BLOCK_RATE)
    both = flex_estimate_ms("allgather", SHAPE, work, dtype="bfloat16", machine=m, backward=True)
    assert both == pytest.approx(1.5 * block_ms * (1 + m.bwd_factor))


def test_head_groups_hide_all_but_the_first_groups_gather():
    m = CPMachine(link_bytes_per_s=50e9, alpha_s=0.0, flops_per_s=400e12, launch_s=0.0)
    work = causal_work(2)
    one, two = (flex_estimate_ms(s, SHAPE, work, dtype="bfloat16", machine=m) for s in ("allgather", "allgather:g=2"))
    gather_ms = 2 * 8 * (32768 // 2) * 128 * 2 / 50e9 * 1e3
    assert one - two == pytest.approx(gather_ms / 2)  # compute outlasts a group's gather: half the gather hidden
    assert flex_estimate_ms("allgather:g=3", SHAPE, work, dtype="bfloat16", machine=m) == math.inf  # 8 KV heads


def test_a_per_head_mask_runs_in_one_group_and_the_ranking_is_sorted():
    assert flex_candidates(SHAPE, per_head_mask=True) == ["ring", "allgather"]
    assert flex_candidates(SHAPE, per_head_mask=False) == ["ring", "allgather", "allgather:g=2", "allgather:g=4"]
    m = CPMachine(link_bytes_per_s=300e9, alpha_s=20e-6, flops_per_s=400e12, launch_s=20e-6)
    ranked = rank_flex_schedules(SHAPE, causal_work(4), dtype="bfloat16", machine=m, backward=True)
    assert {n for n, _ in ranked} == set(flex_candidates(SHAPE, False, 4))
    assert ranked[-1][0] == "ring"  # same bytes moved, slower blocks


def test_a_programs_ulysses_is_priced_at_the_average_work_and_its_all_to_alls():
    # heads balance Ulysses exactly: with free links it takes the average rank's work, where the
    # all-gather schedule on contiguous causal shares takes the busiest's (1.5 of 1.0 at W=2)
    free = CPMachine(link_bytes_per_s=1e30, alpha_s=0.0, flops_per_s=400e12, launch_s=0.0)
    block_ms = 4 * 32 * (32768 // 2) ** 2 * 128 / 400e12 * 1e3
    work = causal_work(2)
    assert ulysses_ms(SHAPE, work, dtype="bfloat16", machine=free) == pytest.approx(1.0 * block_ms)
    # a slow link: its four all-to-alls a pass (q and out of 32 heads, k and v of 8) are what it pays
    slow = CPMachine(link_bytes_per_s=1e9, alpha_s=0.0, flops_per_s=1e30, launch_s=0.0)
    moved = (2 * 32 + 2 * 8) * (32768 // 2) * 128 * 2 / 2  # bytes a rank sends: half of each share leaves
    assert ulysses_ms(SHAPE, work, dtype="bfloat16", machine=slow) == pytest.approx(moved / 1e9 * 1e3)


def test_the_hybrid_is_a_candidate_where_its_ulysses_ranks_split_the_heads_and_the_mask_is_whole():
    assert [c for c in flex_candidates(SHAPE, False, 4) if c.startswith("hybrid")] == ["hybrid:2:2"]
    assert [c for c in flex_candidates(SHAPE, False, 8) if c.startswith("hybrid")] == ["hybrid:2:4", "hybrid:4:2"]
    assert [c for c in flex_candidates((1, 32, 2, 32768, 128), False, 8) if "hybrid" in c] == ["hybrid:2:4"]
    assert not [c for c in flex_candidates(SHAPE, False, 8, own_rows=True) if "hybrid" in c]
    assert not [c for c in flex_candidates(SHAPE, True, 8) if "hybrid" in c]
    assert not [c for c in flex_candidates(SHAPE, False, 2) if "hybrid" in c]


def test_a_segments_work_is_the_mean_of_its_ranks_blocks():
    assert segment_work(causal_work(4), 2) == [[0.5, 0.0], [1.0, 0.5]]  # causal again, over 2 segments
    assert segment_work([[1.0, 0.0], [0.0, 1.0]], 2) == [[0.5]]


def test_the_hybrid_is_its_ring_over_the_segments_on_a_head_shard_plus_its_all_to_alls():
    free = CPMachine(link_bytes_per_s=1e30, alpha_s=0.0, flops_per_s=400e12, launch_s=0.0)
    ring_r = flex_estimate_ms("ring", (1, 16, 4, 32768, 128), causal_work(2), dtype="bfloat16", machine=free)
    hybrid = flex_estimate_ms("hybrid:2:2", SHAPE, causal_work(4), dtype="bfloat16", machine=free)
    assert hybrid == pytest.approx(ring_r)  # free links: the ring of 2 segments on half the heads
    assert flex_estimate_ms("hybrid:2:2", SHAPE, causal_work(8), dtype="bfloat16", machine=free) == math.inf
    assert flex_estimate_ms("hybrid:16:2", (1, 32, 8, 32768, 128), causal_work(32), dtype="bfloat16",
                            machine=free) == math.inf  # 16 Ulysses ranks do not split 8 KV heads
    # a slow link: the all-to-alls of q, k, v and out over 2 ranks are added to the ring's transfers
    slow = CPMachine(link_bytes_per_s=1e9, alpha_s=0.0, flops_per_s=1e30, launch_s=0.0)
    ring_slow = flex_estimate_ms("ring", (1, 16, 4, 32768, 128), causal_work(2), dtype="bfloat16", machine=slow)
    moved = (2 * 32 + 2 * 8) * (32768 // 4) * 128 * 2 / 2  # a rank's shares, half of each leaving
    assert flex_estimate_ms("hybrid:2:2", SHAPE, causal_work(4), dtype="bfloat16", machine=slow) == \
        pytest.approx(ring_slow + moved / 1e9 * 1e3)


def test_the_one_group_all_gather_that_keeps_its_kv_gathers_nothing_in_the_backward():
    # compute free: the forward + backward is its gathers and its reduce-scatter alone
    m = CPMachine(link_bytes_per_s=50e9, alpha_s=0.0, flops_per_s=1e30, launch_s=0.0)
    work = causal_work(2)
    share = 2 * 8 * (32768 // 2) * 128 * 2  # K + V of one share, bf16
    hop_ms = share / 50e9 * 1e3  # a two-rank gather (or reduce-scatter) of one share's bytes
    again = flex_estimate_ms("allgather", SHAPE, work, dtype="bfloat16", machine=m, backward=True)
    kept = flex_estimate_ms("allgather", SHAPE, work, dtype="bfloat16", machine=m, backward=True, kept_gathers=True)
    assert m.ring_collective(share, 2) * 1e3 == pytest.approx(hop_ms)
    # forward gather + backward gather + dK/dV reduce-scattered in bf16 over two ranks
    assert again == pytest.approx(3 * hop_ms)
    assert kept == pytest.approx(2 * hop_ms)
    # head groups gather again whatever is kept; over four ranks dK/dV travel in fp32
    two = [flex_estimate_ms("allgather:g=2", SHAPE, work, dtype="bfloat16", machine=m, backward=True, kept_gathers=k)
           for k in (False, True)]
    assert two[0] == two[1]
    w4 = causal_work(4)
    base = flex_estimate_ms("allgather", SHAPE, w4, dtype="bfloat16", machine=m, kept_gathers=True)
    both = flex_estimate_ms("allgather", SHAPE, w4, dtype="bfloat16", machine=m, backward=True, kept_gathers=True)
    share4 = 2 * 8 * (32768 // 4) * 128 * 2
    assert both - base == pytest.approx(m.ring_collective(2 * share4, 4) * 1e3)  # one fp32 reduce-scatter
