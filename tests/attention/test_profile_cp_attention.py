"""profile_cp_attention's attention-gap attribution (benchmarks/), on a synthetic timeline."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from profile_cp_attention import attention_gaps  # noqa: E402


def test_gaps_are_where_no_attention_kernel_runs_on_any_stream():
    # two steps; attention on two streams overlaps (no gap between them); a push before the
    # first, a copy in the gap between the two attention stretches, a tail copy after the last
    events = [("Memcpy PtoP", 0.0, 30.0),
              ("cudnn_fprop_a", 30.0, 200.0), ("cudnn_fprop_b", 150.0, 260.0),  # overlapping streams
              ("Memcpy DtoD", 250.0, 300.0),  # 40 us of it in the gap 260-300
              ("cudnn_bprop", 300.0, 500.0),
              ("Memcpy PtoP", 500.0, 520.0)]
    got = attention_gaps(events, steps=2)
    assert got["span_ms"] == round(520 / 2e3, 3)
    assert got["gaps_ms"] == round((30 + 40 + 20) / 2e3, 3) and got["gaps"] == 1.5
    assert got["attention_busy_ms"] == round((520 - 90) / 2e3, 3)
    assert got["during_gaps_ms"] == {"Memcpy PtoP": round(50 / 2e3, 4), "Memcpy DtoD": round(40 / 2e3, 4)}
    first = got["largest"][0]
    assert first["us"] == 40.0 and first["before"] == "cudnn_fprop_b" and first["after"] == "cudnn_bprop"
    assert first["during_us"] == {"Memcpy DtoD": 40.0}
    assert got["largest"][1]["before"] == "(start)" and got["largest"][2]["after"] == "(end)"


def test_no_events():
    assert attention_gaps([], steps=3) == {}
