"""Rank consistency of rewrite decisions, on real gloo groups."""

from __future__ import annotations

from consistency_programs import forced_mismatch, one_rank_missing, store_unreachable, values_differ

from torch_commopt.testing.launch import run_distributed


def test_forced_plan_mismatch_leaves_every_rank_untouched():
    for result in run_distributed(forced_mismatch, 2):
        assert result["rewritten"] == 0
        assert result["collectives_after"] == {"all_gather": 1}
        assert any("NOT rewritten" in n and "plans differ" in n for n in result["notes"])
        assert result["max_abs_diff"] == 0.0


def test_a_missing_rank_ends_in_a_timeout_not_a_hang():
    agreed, detail = run_distributed(one_rank_missing, 2)[0]
    assert not agreed and "did not all publish" in detail


def test_differing_values_are_detected_on_every_rank():
    for agreed, detail in run_distributed(values_differ, 2):
        assert not agreed and "plans differ" in detail


def test_an_unreachable_store_is_an_answer_not_a_crash():
    # (a crash here would surface as an InductorError inside the user's training step)
    for agreed, detail in run_distributed(store_unreachable, 2):
        assert not agreed and "could not publish" in detail and "Broken pipe" in detail
