"""Reading a first call's timing: round-paired ratios against clocks that move between rounds,
the median's distribution-free confidence interval, and the per-sample trace."""

from __future__ import annotations

import math

import pytest
import torch

from torch_commopt.tuner.matmul import autotune, rounds
from torch_commopt.tuner.matmul.model import RegionFacts


def _rows(plan):
    """[(round, schedule, ms)] from {round: (clock factor, {schedule: true ms})}."""
    return [(r, s, ms * factor) for r, (factor, times) in plan.items() for s, ms in times.items()]


def test_paired_reading_cancels_clocks_that_move_between_rounds():
    # the near-tie rounds (a and b only) run later, at clocks 30% slower: their medians rise,
    # c (10% slower than a, not a near-tie) keeps its early samples and looks the fastest
    plan = {r: (1.0, {"a": 1.00, "b": 1.01, "c": 1.10}) for r in range(5)}
    plan.update({r: (1.3, {"a": 1.00, "b": 1.01}) for r in range(5, 15)})
    rows = _rows(plan)
    medians = {s: sorted(ms for _, t, ms in rows if t == s)[len([1 for _, t, _ in rows if t == s]) // 2]
               for s in "abc"}
    assert min(medians, key=medians.get) == "c"  # what medians over unequal rounds conclude
    paired = rounds.paired_ms(rows, "a")
    assert min(paired, key=paired.get) == "a"
    assert paired["c"] / paired["a"] == pytest.approx(1.10)
    assert paired["b"] / paired["a"] == pytest.approx(1.01)


def test_paired_reading_of_a_schedule_never_timed_with_the_reference():
    rows = [(0, "a", 1.0), (1, "b", 0.5)]
    assert rounds.paired_ms(rows, "a") == {"a": 1.0, "b": math.inf}


@pytest.mark.parametrize("n, ranks", [(25, (8, 18)), (15, (4, 12)), (6, (1, 6))])
def test_median_confidence_interval_is_the_binomial_order_statistics(n, ranks):
    values = [float(v) for v in range(1, n + 1)]  # x_(k) == k
    assert rounds.median_ci(list(reversed(values))) == ranks


def test_median_confidence_interval_is_unbounded_below_six_samples():
    assert rounds.median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) == (-math.inf, math.inf)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("paired", [False, True])
def test_measure_candidates_traces_every_sample(fake_world, monkeypatch, paired):
    import types

    import torch.distributed as dist

    clock = [0.0]  # a fake clock: a call takes exactly its delay, so a and b tie exactly
    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(autotune, "TARGET_S", {"cpu": 1e-4, "cuda": 1e-4})
    delay = {"a": 2e-4, "b": 2e-4, "c": 2e-3}  # a and b tie: they get the near-tie rounds

    def run(s):
        clock[0] += delay[s]

    trace = []
    got = autotune.measure_candidates(run, ["a", "b", "c"], dist.group.WORLD.group_name, torch.device("cpu"),
                                      timing=autotune.Timing(paired=paired), readings=autotune.Readings(trace=trace))
    rounds = sorted({r for r, _, _ in trace})
    assert rounds == list(range(autotune.ROUNDS + autotune.EXTRA_ROUNDS))
    assert sum(1 for _, s, _ in trace if s == "c") == autotune.ROUNDS
    assert sum(1 for _, s, _ in trace if s == "a") == autotune.ROUNDS + autotune.EXTRA_ROUNDS
    assert all(ms > 0 for _, _, ms in trace)
    assert set(got) == {"a", "b", "c"} and got["c"] > 3 * max(got["a"], got["b"])


def test_rotated_rounds_keep_each_candidates_predecessor_shuffled_ones_vary_it():
    rotated = [rounds.round_order([0, 1, 2, 3], r, "rotate") for r in range(4)]
    assert rotated == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]]
    shuffled = [rounds.round_order([0, 1, 2, 3], r, "shuffle", 5) for r in range(12)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in shuffled)
    assert shuffled == [rounds.round_order([0, 1, 2, 3], r, "shuffle", 5) for r in range(12)]  # every rank alike
    before_2 = {order[order.index(2) - 1] for order in shuffled if order.index(2) > 0}
    assert len(before_2) > 1  # rotated, 1 always runs right before 2
    with pytest.raises(ValueError, match="round order"):
        rounds.round_order([0, 1], 0, "sorted")


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_measure_candidates_in_shuffled_rounds_times_each_candidate_once_a_round(fake_world, monkeypatch):
    import types

    import torch.distributed as dist

    clock = [0.0]
    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(autotune, "TARGET_S", {"cpu": 1e-4, "cuda": 1e-4})
    delay = {"a": 2e-4, "b": 3e-4, "c": 2e-3, "d": 1e-3}

    def run(s):
        clock[0] += delay[s]

    trace = []
    got = autotune.measure_candidates(run, list(delay), dist.group.WORLD.group_name, torch.device("cpu"),
                                      timing=autotune.Timing(order="shuffle"), readings=autotune.Readings(trace=trace))
    for r in range(autotune.ROUNDS):
        assert sorted(s for t, s, _ in trace if t == r) == ["a", "b", "c", "d"]
    assert [s for t, s, _ in trace if t < 2] != ["a", "b", "c", "d", "b", "c", "d", "a"]  # not rotated
    assert got["a"] < got["b"] < got["d"] < got["c"]


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("paired, want", [(False, "c"), (True, "a")])
def test_clocks_dropping_during_the_near_tie_rounds(fake_world, monkeypatch, paired, want):
    # 2x H100: a power-capped card slowed ~9% from the 5th round on.  The near-ties
    # a and b then take their extra rounds slow; c (5% slower, no extra rounds) keeps its fast
    # samples and wins by medians; the paired read still finds a
    import types

    import torch.distributed as dist

    clock, calls = [0.0], [0]
    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(autotune, "TARGET_S", {"cpu": 1e-4, "cuda": 1e-4})
    delay = {"a": 1.00e-3, "b": 1.01e-3, "c": 1.05e-3}
    # each call outlasts TARGET_S: two untimed calls (a warm-up, one sizing), then the first rounds
    first_rounds = 2 * len(delay) + autotune.ROUNDS * len(delay)

    def run(s):
        calls[0] += 1
        clock[0] += delay[s] * (1.3 if calls[0] > first_rounds else 1.0)

    got = autotune.measure_candidates(run, list(delay), dist.group.WORLD.group_name, torch.device("cpu"),
                                      timing=autotune.Timing(paired=paired))
    assert calls[0] == first_rounds + 2 * autotune.EXTRA_ROUNDS  # a and b were the near-ties
    assert min(got, key=got.get) == want
    if paired:
        assert got["c"] / got["a"] == pytest.approx(1.05)


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("warmup, sizing, want", [(1, 1, "b"), (autotune.WARMUP_CALLS, autotune.SIZING_CALLS, "a")])
def test_a_candidate_slow_in_its_first_calls_is_not_measured_slow(fake_world, monkeypatch, warmup, sizing, want):
    # 2x H100: the schedule whose per-call graphs a fresh process captured first was
    # sized from a call that still paid for it, so each of its samples held a call or two and the
    # fixed start of a sample (the idle device's first launch after the barrier): 15-25% slow for
    # the whole measurement.  Here a's second and fourth calls take 20 ms (first uses, captures)
    # and a sample's first call starts 0.3 ms late; one warm-up and one sizing call (the old way)
    # make b, 2% slower, win
    import types

    import torch.distributed as dist

    clock, fresh = [0.0], [False]
    seen = {"a": 0, "b": 0}
    barrier = dist.barrier

    def barrier_then_idle(*args, **kwargs):
        fresh[0] = True
        return barrier(*args, **kwargs)

    monkeypatch.setattr(autotune, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(autotune, "TARGET_S", {"cpu": 5e-3, "cuda": 5e-3})
    monkeypatch.setattr(autotune, "WARMUP_CALLS", warmup)
    monkeypatch.setattr(autotune, "SIZING_CALLS", sizing)
    monkeypatch.setattr(autotune.dist, "barrier", barrier_then_idle)
    delay = {"a": 1.00e-3, "b": 1.02e-3}

    def run(s):
        seen[s] += 1
        clock[0] += (20e-3 if s == "a" and seen[s] in (2, 4) else delay[s]) + (3e-4 if fresh[0] else 0.0)
        fresh[0] = False

    got = autotune.measure_candidates(run, list(delay), dist.group.WORLD.group_name, torch.device("cpu"))
    assert min(got, key=got.get) == want


@pytest.mark.parametrize("paired", [False, True])
def test_a_decision_read_another_way_is_not_reused(monkeypatch, paired):
    # the band's, autotune's and the attention tuner's cache keys name the read
    from torch_commopt.tuner.attention.tune import cache_key
    from torch_commopt.tuner.calibration import prior

    monkeypatch.setattr(autotune, "PAIRED", paired)
    facts = RegionFacts("matmul_rs", [8192, 4096], [[4096, 8192]], 0, 2, "bfloat16", reduce_op="sum")
    *_, plan_key, _ = autotune.plan(facts, "NVIDIA H100 80GB HBM3", prior("NVIDIA H100 80GB HBM3", 2), 8, 4)
    band = RegionFacts("matmul_rs", [8, 4], [[4, 4]], 0, 2, "float32")
    keys = [autotune.band_key(band, "cpu", ["sequential", "direct:1"]),
            cache_key((1, 4, 4, 64, 1024), 2, True, "bfloat16", True, "cpu", ["ulysses", "ring"]), plan_key]
    assert all(("read" in k) == paired for k in keys)
    if paired:
        assert {k["read"] for k in keys} == {"paired"}


def _slow_first_calls_on_rank_1(rank: int, world: int) -> int:
    import time

    import torch.distributed as dist

    calls = [0]

    def run(_schedule):  # collective, as every schedule is
        calls[0] += 1
        dist.all_reduce(torch.ones(1))
        if rank == 1 and calls[0] <= 2:
            time.sleep(0.03)  # longer than a CPU sample's TARGET_S, on this rank only

    autotune.measure_candidates(run, ["a"], dist.group.WORLD.group_name, torch.device("cpu"),
                                timing=autotune.Timing(rounds=1))
    return calls[0]


def test_every_rank_makes_the_same_untimed_calls():
    # 2x H100: a first form of the warm-up stopped early where a rank's own calls
    # were long; a rank whose calls waited on a peer's first use stopped, its peer went on, and the
    # next collective hung.  Here rank 1's first two calls are long and rank 0's first is not
    from torch_commopt.testing.launch import run_distributed

    calls = run_distributed(_slow_first_calls_on_rank_1, 2, timeout_s=120)
    assert calls[0] == calls[1]
