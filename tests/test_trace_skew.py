"""benchmarks/trace_skew.py on synthetic two-rank traces: idle split into waiting for the peer and the rest."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from trace_skew import report, split_idle  # noqa: E402
from trace_compare import device_events  # noqa: E402


def _events(rows):
    return device_events([{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}
                          for cat, name, ts, dur in rows])


PUSH = "Memcpy PtoP (Device -> Device)"
RANK0 = [("kernel", "gemm_own", 0, 100), ("kernel", "gemm_peer", 250, 100),  # waits 150 us for rank 1's push
         ("kernel", "add", 358, 10),  # an 8 us local gap (a flag / event wait)
         ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 400, 20),  # a pull 32 us after the peer's kernel
         ("kernel", "tail", 430, 10)]
RANK1 = [("kernel", "late_gemm", 0, 150), ("gpu_memcpy", PUSH, 150, 95),  # the push lands at 245
         ("kernel", "gemm_b", 260, 135),  # ends at 395: the pull at 400 waited for it
         ("kernel", "tail", 430, 10)]


def test_gaps_after_the_peers_push_or_before_a_pull_count_as_waiting_for_it():
    s = split_idle(_events(RANK0), _events(RANK1), min_us=5, slack_us=20)
    assert (s["peer_gaps"], s["peer_us"]) == (2, 150 + 32), s
    assert (s["local_gaps"], s["local_us"]) == (2, 8 + 10), s
    assert s["idle_us"] == 200 and s["span_us"] == 440
    assert s["by_pair"][0][:2] == ("Memcpy DtoD (Device -> Device)", "tail")
    # a gap ending long after the push is the rank's own
    late = split_idle(_events(RANK0), _events(RANK1), min_us=5, slack_us=2)
    assert late["peer_gaps"] == 0 and late["local_us"] == 200


def test_report_is_per_step(tmp_path):
    paths = []
    for r, rows in enumerate((RANK0, RANK1)):
        p = tmp_path / f"commopt_sustained_rank{r}.json"
        p.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": c, "name": n, "ts": t, "dur": d, "args": {"stream": 7}}
                                                 for c, n, t, d in rows]}))
        paths.append(str(p))
    text = "\n".join(report(*paths, min_us=5, slack_us=20, steps=2))
    assert "| 0 | 0.22 | 0.100 (2 gaps) | 0.091 (1.0) | 0.009 (1) |" in text, text
