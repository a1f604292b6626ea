"""bench_attention's timing window: the lead calls before each sample, and what the report says."""

from __future__ import annotations

from benchmarks import bench_attention


def test_each_sample_follows_the_lead_calls_untimed():
    calls = []
    ms = bench_attention.Clock("cpu").time_ms(lambda: calls.append(1), 3, lead=2)
    assert len(calls) == 5 and ms >= 0


def test_the_default_lead_opens_the_window_on_a_busy_device():
    assert bench_attention.parse_args(["--cpu"]).lead == bench_attention.LEAD_CALLS >= 1
    assert bench_attention.parse_args(["--cpu", "--lead", "0"]).lead == 0


def _meta(lead: int) -> dict:
    return {"device": "NVIDIA H200", "world": 2, "date": "2026-11-28", "torch": "2.11", "triton": "3.6",
            "commit": "abc", "dtype": "bfloat16", "command": "python3 bench_attention.py", "lead_calls": lead}


def test_the_report_says_how_each_window_opened():
    assert "follow 1 untimed one queued right before them" in bench_attention.report([], _meta(1))
    assert "follow 2 untimed ones" in bench_attention.report([], _meta(2))
    idle = bench_attention.report([], _meta(0))
    assert "no lead: each sample's window opens on an idle device" in idle and "untimed" not in idle
