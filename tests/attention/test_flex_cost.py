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
    assert {n for n, _ in ranked} == set(flex_candidates(SHAPE, per_head_mask=False))
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
