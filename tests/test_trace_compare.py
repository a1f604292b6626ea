"""benchmarks/trace_compare.py on synthetic Chrome traces: what ran beside each kernel."""

import json
import pathlib
import sys

import pytest

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


def test_gemm_kernels_are_tied_to_the_matmul_that_launched_them(tmp_path):
    # host thread 5: aten::mm (512 x 256 @ 256 x 128) launches kernel correlation 7 through the
    # driver; an addmm_ launches correlation 8; a kernel with no host op in the trace is skipped
    doc = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 5,
         "args": {"Input Dims": [[512, 256], [256, 128]]}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 10, "dur": 5, "tid": 5, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst", "ts": 100, "dur": 2.0, "args": {"correlation": 7, "stream": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm_", "ts": 60, "dur": 50, "tid": 5,
         "args": {"Input Dims": [[512, 128], [512, 256], [256, 128], [], []]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 70, "dur": 5, "tid": 5, "args": {"correlation": 8}},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_badd", "ts": 110, "dur": 4.0, "args": {"correlation": 8, "stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm", "ts": 120, "dur": 1.0, "args": {"correlation": 9, "stream": 7}},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    got = summarize(str(path))["gemms"]
    flop = 2.0 * 512 * 256 * 128
    assert set(got) == {"mm 512x256x128", "addmm_ 512x256x128"}
    assert got["mm 512x256x128"]["n"] == 1 and got["mm 512x256x128"]["tflops"] == pytest.approx(flop / 2e-6 / 1e12)
    assert got["addmm_ 512x256x128"]["tflops"] == pytest.approx(flop / 4e-6 / 1e12)
