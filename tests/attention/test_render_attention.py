"""render_attention: one report from a cut-short run's partial.jsonl and a finished run."""

from __future__ import annotations

import json

import pytest

from benchmarks.render_attention import load_records, merge


def _rec(s_total: int, h_kv: int = 8) -> dict:
    return {"B": 1, "H": 32, "H_kv": h_kv, "D": 128, "S_total": s_total, "causal": True, "pass": "fwd+bwd",
            "dtype": "bfloat16", "world": 4, "commopt_ms": float(s_total) / 1000}


def test_partial_and_finished_runs_merge_in_order(tmp_path):
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(json.dumps(_rec(s)) for s in (32768, 65536)) + "\n")
    finished = tmp_path / "run.json"
    finished.write_text(json.dumps({"device": "x", "world": 4, "records": [_rec(262144)]}))
    merged = merge([load_records(partial), load_records(finished)])
    assert [r["S_total"] for r in merged] == [32768, 65536, 262144]


def test_a_case_measured_in_two_runs_is_an_error():
    with pytest.raises(ValueError, match="appears in two runs"):
        merge([[_rec(32768)], [_rec(32768, h_kv=8)]])
    assert len(merge([[_rec(32768)], [_rec(32768, h_kv=32)]])) == 2  # another head layout is another case
