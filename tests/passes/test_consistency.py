"""Cross-rank agreement with faults injected, on real gloo groups: every rank ends within a
bounded time, every rank takes the same outcome, and the results stay exact."""

from __future__ import annotations

import pytest
from consistency_programs import (
    TIMEOUT_S,
    dead_peer,
    decided_once,
    forced_mismatch,
    late_rank,
    late_voter_learns,
    recompile_on_one_rank,
    store_unreachable,
    tuning,
    values_differ,
)

from torch_commopt.testing.launch import run_distributed


def test_forced_plan_mismatch_leaves_every_rank_untouched():
    for result in run_distributed(forced_mismatch, 2):
        (graph,) = result["graphs"]
        assert graph["rewritten"] == 0 and graph["collectives_after"] == {"all_gather": 1}
        assert any("NOT rewritten" in n and "did not vote" in n for n in graph["notes"]), graph["notes"]
        assert result["max_abs_diff"] == 0.0


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_rank_late_past_the_timeout_runs_the_original_collectives_like_the_others(world):
    results = run_distributed(late_rank, world, timeout_s=240)
    for rank, result in enumerate(results):
        (graph,) = result["graphs"]
        assert graph["rewritten"] == 0 and graph["collectives_after"] == {"all_gather": 1}, (rank, graph)
        assert result["max_abs_diff"] == 0.0
    late = results[-1]["graphs"][0]["notes"]
    assert any("did not vote" in n and f"[{world - 1}]" in n for n in late), late  # it learned why
    assert results[-1]["seconds"] < TIMEOUT_S + 60  # the late rank did not wait out a timeout of its own


def test_a_recompile_on_one_rank_only_follows_the_outcome_taken_for_that_graph():
    results = run_distributed(recompile_on_one_rank, 2, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["max_abs_diff"] < 1e-5, rank
        assert all(g["rewritten"] == 1 for g in result["graphs"]), (rank, result["graphs"])
    assert len(results[1]["graphs"]) == 2 and len(results[0]["graphs"]) == 1  # rank 1 alone compiled again
    assert not any("did not vote" in n for g in results[1]["graphs"] for n in g["notes"])


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_dead_peer_is_reported_within_the_timeout_naming_it(world):
    for outcome, seconds in run_distributed(dead_peer, world)[:-1]:
        assert not outcome.agreed and outcome.value is None
        assert f"rank(s) [{world - 1}] did not vote within {TIMEOUT_S:g} s" in outcome.detail, outcome.detail
        assert "plan of graph 7 (forward)" in outcome.detail and "dead-peer" in outcome.detail
        assert seconds < TIMEOUT_S + 5


def test_a_late_voter_reads_the_outcome_the_others_took_at_once():
    (early, _), (late, late_seconds) = run_distributed(late_voter_learns, 2)
    assert not early.agreed and not late.agreed and late.detail == early.detail
    assert late_seconds < 1.0


def test_differing_values_are_detected_on_every_rank():
    for outcome in run_distributed(values_differ, 2):
        assert not outcome.agreed and "values differ" in outcome.detail


def test_a_decided_identity_is_followed_without_waiting():
    for rank, (first, again, seconds) in enumerate(run_distributed(decided_once, 3)):
        assert first.agreed and first.value == "v"
        if rank == 2:
            assert again.agreed and again.value == "v" and seconds < 1.0


@pytest.mark.parametrize("case", ["slow_leader", "failing_leader", "asked_again"])
def test_a_tuning_decision_is_the_same_on_every_rank(case):
    results = run_distributed(tuning, 3, case, timeout_s=120)
    if case == "slow_leader":  # the followers gave up first: nobody adopts the late answer
        assert all(r.startswith("mismatch") and "gave no answer" in r for r, _, _ in results), results
    elif case == "failing_leader":
        assert results[0][0] == "raised: cache unreadable"
        for result, _, seconds in results[1:]:
            assert result.startswith("mismatch") and "could not answer" in result and seconds < TIMEOUT_S
    else:
        for result, again, _ in results:
            assert result == again == {"schedule": "chunked:2"}


def test_an_unreachable_store_is_an_answer_not_a_crash():
    # (a crash here would surface as an InductorError inside the user's training step)
    for outcome, seconds in run_distributed(store_unreachable, 2):
        assert not outcome.agreed and "store is unreachable" in outcome.detail and "Broken pipe" in outcome.detail
        assert "plan of graph 4" in outcome.detail and seconds < 1.0
