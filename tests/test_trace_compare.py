"""benchmarks/trace_compare.py on synthetic Chrome traces: what ran beside each kernel."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

from trace_compare import compare, summarize  # noqa: E402


def _trace(path, events):
    doc = {"traceEvents": [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
                           for cat, name, ts, dur, stream in events]
           + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500, "args": {}}]}
    path.write_text(json.dumps(doc))
    return str(path)


def test_time_beside_copies_and_other_streams(tmp_path):
    base = _trace(tmp_path / "base.json", [("kernel", "flash_bwd", 0, 100, 7), ("kernel", "sm90_gemm", 100, 50, 7)])
    other = _trace(tmp_path / "other.json", [
        ("kernel", "flash_bwd", 0, 120, 7),
        ("gpu_memcpy", "Memcpy PtoP (Device -> Device)", 30, 60, 20),  # 60 of its 120 us beside a copy
        ("kernel", "sm90_gemm", 120, 60, 7),
        ("kernel", "sm90_gemm", 150, 40, 9),  # the two GEMMs overlap 30 us on two streams
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 200, 10, 20)])
    b, o = summarize(base), summarize(other)
    assert b["kernels"]["flash_bwd"] == {"n": 1, "ms": 0.1, "with_copy_ms": 0.0, "with_kernel_ms": 0.0}
    fb = o["kernels"]["flash_bwd"]
    assert (fb["n"], round(fb["ms"], 6), round(fb["with_copy_ms"], 6), fb["with_kernel_ms"]) == (1, 0.12, 0.06, 0.0)
    g = o["kernels"]["sm90_gemm"]
    assert (g["n"], round(g["ms"], 6), round(g["with_kernel_ms"], 6), g["with_copy_ms"]) == (2, 0.1, 0.06, 0.0)
    assert round(o["categories"]["copy to peer"], 6) == 0.06 and round(o["categories"]["copy"], 6) == 0.01
    assert round(o["span_ms"], 6) == 0.21
    text = "\n".join(compare(b, o))
    assert "| attention | 0.100 | 0.120 | +0.020 |" in text
    assert "flash_bwd | attention | 1/1 | 100.0 (0%, 0%) | 120.0 (50%, 0%) | +0.020 |" in text
