"""Tuner cache (round trip, corruption, concurrent writers) and the rank-0 decision."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

import pytest
from tuner_programs import decide_rounds, hammer_cache

from torch_commopt.core.schedule import Schedule
from torch_commopt.testing.launch import run_distributed
from torch_commopt.tuner.cache import CACHE_ENV, TunerCache, default_dir
from torch_commopt.tuner.calibrate import HOST_PROBES

KEY = {"device": "NVIDIA H200", "world": 2, "torch": "2.11.0", "op": "matmul_rs", "shape": [8192, 4096, 8192]}


def test_round_trip_and_independent_keys(tmp_path):
    cache = TunerCache(tmp_path)
    assert cache.get(KEY) is None
    assert cache.put(KEY, {"schedule": "ce_push:2", "ms": [0.85, 0.87]})
    assert cache.get(dict(reversed(list(KEY.items())))) == {"schedule": "ce_push:2", "ms": [0.85, 0.87]}
    other = dict(KEY, world=4)
    assert cache.get(other) is None
    cache.put(other, "direct:1")
    assert cache.get(other) == "direct:1" and cache.get(KEY)["schedule"] == "ce_push:2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["{not json", "", "[1, 2]", '{"version": 1, "key": {}, "value": 3}',
                                    '{"version": 99, "value": 3}'])
def test_a_corrupt_entry_is_ignored_then_rewritten(tmp_path, caplog, damage):
    cache = TunerCache(tmp_path)
    cache.put(KEY, {"schedule": "ce_push:2"})
    cache.path(KEY).write_text(damage)
    with caplog.at_level(logging.WARNING, logger="torch_commopt.tuner.cache"):
        assert cache.get(KEY) is None
    assert "ignoring" in caplog.text
    cache.put(KEY, {"schedule": "direct:1"})
    assert cache.get(KEY) == {"schedule": "direct:1"}


def test_an_unwritable_directory_only_costs_the_remembering(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = TunerCache(blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="torch_commopt.tuner.cache"):
        assert cache.put(KEY, 1) is False
    assert cache.get(KEY) is None and "could not write" in caplog.text


def test_two_processes_writing_one_cache(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(hammer_cache, [(str(tmp_path), w, 150) for w in range(2)])
    assert results == [[], []], results
    assert TunerCache(tmp_path).get({"op": "ag_matmul", "M": 4096})["writer"] in (0, 1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_cache_directory_override(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert default_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_dir() == tmp_path / "x" / "torch_commopt"


def test_rank0_decides_for_every_rank_over_gloo():
    per_rank = run_distributed(decide_rounds, 2, None, timeout_s=120)
    for rank, rounds in enumerate(per_rank):
        for i, (value, ran) in enumerate(rounds):
            assert value == {"schedule": f"chunked:{2 + i}", "decided_by": 0}
            assert ran == (rank == 0)  # the others adopt, never compute


def test_a_rank_asking_another_question_gets_an_error_not_an_answer():
    per_rank = run_distributed(decide_rounds, 2, 1, timeout_s=120)
    assert per_rank[0][1][0] == {"schedule": "chunked:3", "decided_by": 0}
    # rank 0 never answers rank 1's question: rank 1 is told so once its wait is up
    assert str(per_rank[1][1][0]).startswith("mismatch:") and "rank 0 gave no answer" in per_rank[1][1][0]
    # the decisions after it still line up
    assert per_rank[1][2][0] == {"schedule": "chunked:4", "decided_by": 0}


def test_without_a_process_group_the_answer_is_local():
    from torch_commopt.tuner.decide import decide

    assert decide(None, {"q": 1}, lambda: {"x": os.getpid()}, timeout_s=1) == {"x": os.getpid()}


def test_calibration_is_measured_once_and_the_model_mode_reads_it(tmp_path):
    from tuner_programs import calibrate_program, compile_with_model

    from torch_commopt.tuner.calibration import Calibration

    before = run_distributed(compile_with_model, 2, str(tmp_path), timeout_s=300)
    for cands, chosen, note, err in before:
        assert "prior calibration of cpu" in note and chosen == cands[0]["schedule"] and err < 1e-5
    measured = run_distributed(calibrate_program, 2, str(tmp_path), timeout_s=300)
    (text0, spent0, phases), (text1, _, _) = measured
    assert text0 == text1 and spent0 < 30  # every rank holds the same figures
    # where the time went, by phase (logged with the total; bench_costmodel records it)
    assert {"host", "gemm", "collectives", "attention"} <= set(phases) and 0 < sum(phases.values()) <= spent0
    cal = Calibration.from_json(text0)
    assert cal.source == "measured" and cal.device == "cpu" and cal.gemm["float32"].peak_flops > 1e8
    # host costs measured in two passes; any figure they disagreed on is named (a third pass decided it)
    assert {r.removeprefix("host ") for r in cal.remeasured} <= {f"{k} {s}" for k, s in HOST_PROBES["cpu"]}
    # the local attention kernel (math on CPU) measured too: its throughput and backward factor
    # (a backward timed no slower than its forward is a disturbed measurement: then 0, the
    # model's default, and not listed as measured)
    assert cal.attention_flops["float32"] > 1e7 and "attention_flops" in cal.measured
    if "attention_bwd_factor" in cal.measured:
        assert 1.0 < cal.attention_bwd_factor < 10.0
    else:
        assert cal.attention_bwd_factor == 0.0
    after = run_distributed(compile_with_model, 2, str(tmp_path), timeout_s=300)
    for cands, chosen, note, err in after:
        assert "measured calibration of cpu" in note and err < 1e-5
        assert chosen == cands[0]["schedule"] and cands == sorted(cands, key=lambda c: c["predicted_ms"])
    assert after[0][:3] == after[1][:3]  # every rank ranks with the same numbers


def test_autotune_times_at_the_first_call_caches_and_every_rank_agrees(tmp_path):
    """mode="autotune": the first call times the model's top candidates and sequential
    (every rank, slowest counts), runs the fastest; a later run reads the cache instead.  (Within
    one process a question is answered once: core/consistency.py keys decisions by identity, so
    a rank that recompiles alone gets the answer its peers compiled with.)"""
    from tuner_programs import compile_with_autotune

    (cold0,), (cold1,) = run_distributed(compile_with_autotune, 2, str(tmp_path), timeout_s=600)
    (warm0,), (warm1,) = run_distributed(compile_with_autotune, 2, str(tmp_path), timeout_s=600)
    for cands, scheds, notes, err, _, _ in (cold0, cold1):
        assert err < 1e-5 and len(cands) == 2
        assert all(s.startswith("autotune:1:id=") for s in scheds), scheds  # placeholders until the first call
        for rows in cands.values():
            timed = {r["schedule"]: r["measured_ms"] for r in rows if r["measured_ms"] is not None}
            # the top 2, the other piece counts of their families (chunked:2 brings chunked:4 ...), sequential
            families = {(s.name, s.params) for s in (Schedule.parse(r["schedule"]) for r in rows[:2])}
            siblings = {r["schedule"] for r in rows if (Schedule.parse(r["schedule"]).name,
                                                         Schedule.parse(r["schedule"]).params) in families}
            assert "sequential" in timed and set(timed) == siblings | {"sequential"}, timed
        assert sum("autotune measured" in n for n in notes) == 2
    assert cold0[0] == cold1[0]  # the same measurements (slowest rank's) on both ranks
    from torch_commopt.tuner.matmul.autotune import MODEL_TIE, winner

    winners = {}
    for rows in cold0[0].values():  # the fastest, or the model's pick (rows[0]) within MODEL_TIE of it
        timed = {r["schedule"]: r["measured_ms"] for r in rows if r["measured_ms"] is not None}
        winners[winner(timed, prior=rows[0]["schedule"], tie=MODEL_TIE)] = True
    for _cands, scheds, notes, err, _first, _ in (warm0, warm1):
        assert err < 1e-5 and not any(s.startswith("autotune") for s in scheds)
        assert set(scheds) <= set(winners), (scheds, winners)
        assert sum("cached measurement" in n for n in notes) == 2
    assert warm0[1] == warm1[1]


def test_tune_cli_prefills_what_the_pass_asks_for(tmp_path):
    """`python -m torch_commopt tune --shape ...` times the same candidates under the same
    keys as the pass: a later autotune compile times nothing."""
    from tuner_programs import compile_after_tune

    from torch_commopt.__main__ import main

    # the local A of each region: the AG shard (256, 64) @ (64, 96); the RS input (512, 96) @ (96, 32)
    assert main(["tune", "--shape", "ag_matmul:256x64x96", "--shape", "matmul_rs:512x96x32", "--world", "2",
                 "--top-k", "2", "--cache-dir", str(tmp_path)]) == 0
    for scheds, notes, err in run_distributed(compile_after_tune, 2, str(tmp_path), timeout_s=300):
        assert err < 1e-5 and not any(s.startswith("autotune") for s in scheds), scheds
        assert sum("cached measurement" in n for n in notes) == 2, notes


def test_tune_cli_rejects_bad_shapes():
    from torch_commopt.tuner.tune import parse_shape

    with pytest.raises(ValueError, match="unknown kind"):
        parse_shape("conv:1x2x3")
    with pytest.raises(ValueError, match="want KIND"):
        parse_shape("ag_matmul:1x2")
    with pytest.raises(ValueError, match="one weight"):
        parse_shape("matmul_rs:4x2x3,5")
