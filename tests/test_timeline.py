"""The step picture (torch_commopt/timeline.py): a hand-written trace whose every span, region and
gap is known, and a recorded one (tests/data: a MoE layer profiled on 2x H200, trimmed)."""

from __future__ import annotations

import gzip
import json
import pathlib

import pytest

from torch_commopt import timeline
from torch_commopt.cli import main

DATA = pathlib.Path(__file__).parent / "data"


def _event(cat, name, ts, dur, tid=7, pid=0, correlation=None, **args):
    if correlation is not None:
        args["correlation"] = correlation
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace() -> dict:
    """Two steps; the second (GPU annotation from t=1000): a GEMM on stream 7, the copy engine on
    stream 9, NCCL on stream 11, a commopt op that launched the GEMM and the copy, idle between."""
    host = 123
    events = [
        _event("gpu_user_annotation", "ProfilerStep#1", 0, 900),
        _event("kernel", "early_gemm", 10, 100, correlation=1),  # the first step: left out
        _event("gpu_user_annotation", "ProfilerStep#2", 1000, 400),
        _event("kernel", "nvjet_gemm", 1000, 100, correlation=11),
        _event("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 1050, 80, tid=9, correlation=12),
        _event("kernel", "ncclDevKernel_AllGather_RING_LL", 1200, 50, tid=11, correlation=13),
        _event("kernel", "silu", 1300, 100, correlation=14),
        _event("cpu_op", "commopt::matmul_rs", 900, 60, tid=host, **{"Concrete Inputs": ["", "", "sum", "0", "ce_push:2"]}),
        _event("cuda_runtime", "cudaLaunchKernel", 905, 5, tid=host, correlation=11),
        _event("cuda_driver", "cuMemcpyDtoDAsync", 920, 5, tid=host, correlation=12),
        _event("cuda_runtime", "cudaLaunchKernel", 990, 5, tid=host, correlation=14),  # after the op: not its
        _event("user_annotation", "nccl:all_gather", 1100, 20, tid=host),
        _event("cuda_runtime", "ncclLaunch", 1105, 5, tid=host, correlation=13),
    ]
    return {"traceEvents": events}


def test_a_trace_becomes_lanes_regions_and_gaps():
    step = timeline.load(_trace(), "commopt")
    assert step.duration == 400 and step.lanes == ["GPU 0 stream 7", "GPU 0 stream 9", "GPU 0 stream 11"]
    kinds = {s.name: (s.kind, s.start, s.end) for s in step.spans}
    assert kinds == {"nvjet_gemm": ("compute", 0, 100), "Memcpy PtoP (Device -> Device)": ("copy", 50, 130),
                     "ncclDevKernel_AllGather_RING_LL": ("nccl", 200, 250), "silu": ("compute", 300, 400)}
    # the op's region covers what it launched, labelled with its schedule; the NCCL range its kernel
    assert sorted((r.label, r.start, r.end) for r in step.regions) == [("matmul_rs ce_push:2", 0, 130),
                                                                        ("nccl:all_gather", 200, 250)]
    assert step.gaps == [(130, 200), (250, 300)]
    assert step.summary() == {"step_ms": 0.4, "compute_ms": 0.2, "copy_ms": 0.08, "nccl_ms": 0.05,
                              "idle_ms": 0.12, "gaps": 2}


def test_without_profiler_steps_the_whole_gpu_span_is_the_step_and_short_gaps_are_jitter():
    events = [e for e in _trace()["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    step = timeline.load({"traceEvents": events}, "x", min_gap_us=80)
    assert step.duration == 1400 - 10 and step.gaps == [(110 - 10, 1000 - 10)]  # (130, 200) is under 80 us
    with pytest.raises(ValueError, match="no GPU kernel"):
        timeline.load({"traceEvents": [e for e in events if e["cat"] == "cpu_op"]}, "host only")


def test_a_recorded_step_draws_as_png_and_html(tmp_path):
    recorded = json.loads(gzip.open(DATA / "moe_a2a_h200x2_trace.json.gz").read())
    step = timeline.load(recorded, "commopt a2a (2x H200)")
    s = step.summary()
    assert step.lanes == ["GPU 0 stream 7"] and s["nccl_ms"] > 0 and s["compute_ms"] > s["nccl_ms"]
    assert any(r.label == "nccl:all_to_all" for r in step.regions)
    assert 0 < s["idle_ms"] < s["step_ms"] and s["gaps"] == len(step.gaps) > 0
    busy = timeline.merge_intervals([(x.start, x.end) for x in step.spans])
    assert timeline.total_length(busy) / 1e3 + s["idle_ms"] <= s["step_ms"] + 1e-9
    synthetic = timeline.load(_trace(), "hand-written")
    timeline.render([step, synthetic], tmp_path / "t.png", tmp_path / "t.html")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "t.html").read_text()
    assert "<svg" in page and "commopt a2a (2x H200)" in page and "hand-written" in page


def test_the_command_writes_both_files(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps(_trace()))
    assert main(["timeline", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--label", "commopt",
                 "--label", "inductor", "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "timeline.png").exists() and (tmp_path / "out" / "timeline.html").exists()
    assert "commopt {" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["timeline", str(tmp_path / "a.json"), "--label", "x", "--label", "y"])
