"""probe_fused_gemm's reports (the probe itself needs a GPU): each region's best tile and default
against cuBLAS, and the cuBLAS schedules' pieces against whole, from the raw times."""

from benchmarks import probe_fused_gemm as probe


def test_the_reports_give_the_ratios_of_the_times():
    rows = [{"region": "wo", "kind": "rs", "m": 8192, "k": 2048, "ns": [4096], "ms": {}, "cublas_ms": 0.2,
             "best": "128x256x64 w8 s4 g8", "best_ms": 0.25, "default_ms": 0.4, "ratio_best": 0.8,
             "ratio_default": 0.5, "cublas_tflops": 687.0}]
    meta = {"device": "GPU", "commit": "c", "date": "d", "torch": "t", "triton": "x", "command": "cmd", "rounds": 7}
    text = probe.report(rows, meta)
    assert "| wo | GEMM+RS | 8192 x 2048 x 4096 | 0.200 (687) | 0.400 | 0.500 | 128x256x64 w8 s4 g8 | 0.250 | 0.800 |" \
        in text, text
    cut = [{"batch": 4, "seq": 2048, "region": "qkv", "kind": "ag", "ms": {"whole": 0.3, "pieces": 0.315},
            "ratio": 1.05}]
    assert "| 4 x 2048 | qkv | 0.300 | 0.315 | 1.050 |" in probe.pieces_report(cut)
