"""bench_moe on CPU/gloo (2 ranks, a tiny layer): every variant runs fwd+bwd, commopt's schedules
give torchtitan's EP output, and the report derives its figures from the raw times."""

import pytest

from torch_commopt.testing.optional import torchtitan_or_skip

torchtitan_or_skip()

from benchmarks import bench_moe  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402


def test_the_cpu_smoke_run_measures_every_variant_and_agrees_with_torchtitan():
    per_rank = run_distributed(bench_moe._rank, 2, bench_moe.CPU_MODELS, ([32], ["balanced", "skewed"]), 1, 1, False,
                               bench_moe.VARIANTS, backend="gloo", timeout_s=300)
    cases, device = per_rank[0]
    assert device == "cpu (gloo)" and [c["routing"] for c in cases] == ["balanced", "skewed"]
    for c in bench_moe.records(cases):
        assert set(c["ms"]) == set(bench_moe.VARIANTS) and all(ms > 0 for ms in c["ms"].values())
        # fp32 on CPU, torchtitan's grouped GEMM in bf16 on both sides: the same rows in the same order
        assert max(c["max_rel_error"].values()) < 1e-2, c["max_rel_error"]
    meta = {"device": device, "world": 2, "commit": "c", "date": "d", "torch": "t", "rounds": 1, "steps": 1}
    text = bench_moe.report(cases, meta)
    assert "| tiny | 32 | balanced |" in text and "| tiny | 32 | skewed |" in text


def test_speedup_and_hidden_share_come_from_the_times():
    ms = {"torchtitan EP": 10.0, "commopt a2a": 10.0, "commopt by_peer": 8.0, "commopt by_expert": 7.0,
          "commopt by_expert nccl": 9.0, "commopt auto": 7.0, "comm-free": 6.0}
    (c,) = bench_moe.records([{"ms": ms, "max_rel_error": {v: 0.0 for v in ms}, "model": "m", "tokens_per_rank": 1,
                               "routing": "balanced"}])
    assert c["speedup_vs_torchtitan"]["commopt by_peer"] == pytest.approx(1.25)
    assert c["hidden_share"]["commopt by_peer"] == pytest.approx(0.5) and c["hidden_share"]["commopt a2a"] == 0.0
    assert c["hidden_share"]["commopt by_expert"] == pytest.approx(0.75)
    (c,) = bench_moe.records([dict(c, ms=dict(ms, **{"comm-free": 11.0}))])
    assert c["hidden_share"]["commopt by_peer"] is None  # nothing exposed to hide


def test_runs_split_by_model_join_into_one_report(tmp_path):
    import json

    ms = {v: 1.0 + i for i, v in enumerate(bench_moe.VARIANTS)}
    paths = []
    for i, (model, commit) in enumerate((("dsv2-lite", "a1"), ("mixtral-8x7b", "b2"))):
        meta = {"device": "NVIDIA H200", "world": 2, "commit": commit, "date": "2026-11-29", "torch": "t",
                "rounds": 7, "steps": 5, "command": f"bench_moe --models {model}"}
        case = {"ms": ms, "max_rel_error": {v: 0.0 for v in ms}, "model": model, "tokens_per_rank": 8192,
                "routing": "balanced"}
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps({"meta": meta, "cases": [case]}))
    bench_moe.join([str(p) for p in paths], str(tmp_path / "out"))
    (md,) = (tmp_path / "out").glob("moe_h200x2_2026-11-29.md")
    text = md.read_text()
    assert "| dsv2-lite | 8192 |" in text and "| mixtral-8x7b | 8192 |" in text
    assert "Joined from 2 runs (commits a1, b2)" in text and "`bench_moe --models mixtral-8x7b`" in text
    other = json.loads(paths[1].read_text())
    other["meta"]["world"] = 4
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different cards or worlds"):
        bench_moe.join([str(p) for p in paths], None)


def test_variants_are_named_by_name_or_by_schedule():
    import argparse

    assert bench_moe._variant("a2a") == "commopt a2a" and bench_moe._variant("commopt auto") == "commopt auto"
    assert bench_moe._variant("comm-free") == "comm-free"
    assert bench_moe._variant("by_expert:4") == bench_moe._variant("commopt by_expert:4") == "commopt by_expert:4"
    for bad in ("ring", "by_expert:0", "by_expert:x", "a2a:2"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"unknown variant '{bad}'"):
            bench_moe._variant(bad)


def test_the_graph_mode_s_cpu_smoke_runs_the_eager_variants_and_reports_them():
    from benchmarks import moe_graph

    per_rank = run_distributed(moe_graph.graph_rank, 2, bench_moe.CPU_MODELS, [4, 16], 1, 1, False, backend="gloo",
                               timeout_s=300)
    cases, device = per_rank[0]
    assert device == "cpu (gloo)" and [c["tokens_per_rank"] for c in cases] == [4, 16]
    for c in cases:
        assert set(c["ms"]) == set(moe_graph.EAGER) and all(ms > 0 for ms in c["ms"].values())
        assert max(c["max_rel_error"].values()) < 1e-2, c["max_rel_error"]  # sync_free and a2a give torchtitan's output
    meta = {"device": device, "world": 2, "commit": "c", "date": "d", "torch": "t", "rounds": 1, "steps": 1}
    text = moe_graph.graph_report(cases, meta)
    assert "| tiny | 4 |" in text and "| tiny | 16 |" in text and "sync_free graphed" not in text


def test_the_graph_report_shows_the_replayed_variant_and_a_failed_capture():
    from benchmarks import moe_graph

    ms = {"torchtitan EP": 2.0, "commopt a2a": 1.6, "commopt sync_free": 2.2, "commopt sync_free graphed": 0.5}
    case = {"model": "m", "tokens_per_rank": 8, "ms": ms, "max_rel_error": {v: 1e-3 for v in ms},
            "syncs": {"torchtitan EP": 3, "commopt a2a": 1, "commopt sync_free": 0}, "capture_failed": None}
    meta = {"device": "GPU", "world": 2, "commit": "c", "date": "d", "torch": "t", "rounds": 3, "steps": 10}
    text = moe_graph.graph_report([case, dict(case, capture_failed="operation not permitted")], meta)
    row = [r for r in text.splitlines() if r.startswith("| m | 8 |")]
    assert row[0].endswith("| 1.25 | 0.91 | 4.00 | 3 / 1 / 0 | 1.0e-03 | ok |"), row[0]
    assert row[1].endswith("| failed: operation not permitted |")


def test_the_pieces_report_shows_each_schedule_against_the_plain_one():
    """--pieces' report (one GPU) from its rows: by_expert:1 and sync_free against a2a's same
    exchanges, the chunk counts against by_expert:1; a row from before the a2a baseline shows '-'."""
    ms = {"whole": 4.0, "by source": 5.0, "a2a": 5.0, "sync_free": 5.5, "by_expert:1": 5.1, "by_expert:2": 5.2}
    row = {"model": "m", "world": 2, "tokens_per_rank": 8192, "rows_received": 49152, "ms": ms,
           "ratio": {k: v / ms["whole"] for k, v in ms.items() if k != "whole"},
           "vs_a2a": {"by_expert:1": 5.1 / 5.0, "sync_free": 5.5 / 5.0}, "chunked": {"by_expert:2": 5.2 / 5.1}}
    old = dict(row, ratio={k: v for k, v in row["ratio"].items() if k not in ("a2a", "sync_free")})
    del old["vs_a2a"]
    meta = {"device": "GPU", "commit": "c", "date": "d", "torch": "t", "rounds": 3}
    text = bench_moe.pieces_report([row, old], meta)
    assert "| m | 2 | 8192 | 49152 | 4.000 | 1.250 | 1.250 | 1.020 | 1.100 | 1.020 |" in text, text
    assert "| m | 2 | 8192 | 49152 | 4.000 | 1.250 | - | - | - | 1.020 |" in text, text
