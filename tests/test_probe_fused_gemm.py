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


def test_the_clocks_table_gives_the_regions_clock_and_each_forms_own():
    """The region's SM clock and power over its timing, and the mean clock of the samples taken inside
    the faster cuBLAS form's and the sm90 kernel's own calls (synthetic nvidia-smi output)."""
    import datetime

    from benchmarks import gpu_clocks

    t0 = 1_800_000_000.0
    c = gpu_clocks.ClockSampler()
    c.out = "\n".join(f"{datetime.datetime.fromtimestamp(t0 + dt).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, 0, {mhz}, "
                      f"{watts}, 0x{reasons:016x}"
                      for dt, mhz, watts, reasons in [(0.01, 1500, 690.0, 4), (0.03, 1800, 500.0, 0),
                                                      (0.05, 1600, 650.0, 4)])
    windows = {"cublas": [(t0, t0 + 0.02)], "cublas one GEMM": [(t0 + 0.04, t0 + 0.06)],
               "sm90": [(t0 + 0.025, t0 + 0.035)]}
    got = probe._clocks(c, windows, "cublas one GEMM")
    assert got["region"]["samples"] == 3
    assert (got["cublas"]["sm_mhz_mean"], got["sm90"]["sm_mhz_mean"]) == (1600.0, 1800.0)
    text = probe.clocks_report([{"region": "wo", "clocks": got}, {"region": "w2"}])
    assert "| wo | 1633 (1500-1800) | 613 | 0.67 | 1600 (1) | 1800 (1) |" in text, text
    assert "| w2 | - | - | - | - | - |" in text
