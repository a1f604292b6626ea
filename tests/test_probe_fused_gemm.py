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


def test_sustained_runs_each_kernel_twice_in_alternating_order_and_reads_its_own_clock(monkeypatch):
    """Each kernel's time is the mean of its two back-to-back runs' medians; its clock and power are
    the samples inside its own spans (a fake sampler answers per span); cycles = ms x MHz."""
    calls = []

    def back_to_back(fn, seconds):
        calls.append(fn())
        t = {"cublas": 0.20, "sm90": 0.22}[calls[-1]] + 0.01 * (len(calls) > 2)
        return t, (len(calls), len(calls) + 0.5)

    class Sampler:
        def __init__(self, period_ms):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def summary(self, windows):
            mhz = {"cublas": 1500.0, "sm90": 1400.0}
            return {label: {0: {"samples": 10 * len(spans), "sm_mhz_mean": mhz[label], "power_w_mean": 660.0,
                                "power_capped_share": 1.0}} for label, spans in windows.items()}

    monkeypatch.setattr(probe, "_back_to_back", back_to_back)
    monkeypatch.setattr(probe, "ClockSampler", Sampler)
    got = probe.sustained({"cublas": lambda: "cublas", "sm90": lambda: "sm90"}, 2.5)
    assert calls == ["cublas", "sm90", "sm90", "cublas"]
    assert abs(got["cublas"]["ms"] - 0.205) < 1e-9 and abs(got["sm90"]["ms"] - 0.225) < 1e-9
    assert got["sm90"]["samples"] == 20 and got["sm90"]["sm_mhz"] == 1400.0
    assert abs(got["sm90"]["mcycles"] - 0.225 * 1.4) < 1e-9
    text = probe.sustained_report([{"region": "wo", "sustained": got}, {"region": "w2", "sustained": None}])
    assert "| wo | 0.205 | 1500 | 660 | 1.00 | 0.225 | 1400 | 660 | 1.00 | 0.911 | 1.024 | - | - |" in text, text
    assert "| w2 |" not in text


def test_sustained_without_clock_samples_gives_times_only():
    got = probe._sustained_rows({"cublas": [0.2, 0.2], "sm90": [0.25, 0.25]}, {"cublas": {}, "sm90": {}})
    assert got["sm90"] == {"ms": 0.25, "sm_mhz": None, "power_w": None, "capped": None, "samples": None,
                           "mcycles": None}
    assert "| wo | 0.200 | - | - | - | 0.250 | - | - | - | 0.800 | - | - | - | - | - |" in probe.sustained_report(
        [{"region": "wo", "sustained": got}])


def test_sustained_reports_the_reduction_against_cublas_and_a_separate_add():
    """A reduction's row: the kernel against cuBLAS alone and against cuBLAS + the partial's add."""
    got = probe._sustained_rows({"cublas": [0.2, 0.2], "sm90": [0.22, 0.22], "cublas + add": [0.24, 0.24]},
                                {"cublas": {}, "sm90": {}, "cublas + add": {}})
    text = probe.sustained_report([{"region": "wo", "sustained": got}])
    assert "| wo | 0.200 | - | - | - | 0.220 | - | - | - | 0.909 | - | 0.240 | 1.091 | - | - |" in text, text


def test_sustained_reports_the_reduction_kernel_alone_at_world_1():
    """The kernel at world 1 (no partial) against cuBLAS: its GEMM throughput without the reduction."""
    ms = {"cublas": [0.2, 0.2], "sm90": [0.22, 0.22], "cublas + add": [0.24, 0.24], "sm90 world 1": [0.25, 0.25]}
    got = probe._sustained_rows(ms, {k: {} for k in ms})
    text = probe.sustained_report([{"region": "wo", "sustained": got}])
    assert "| 0.240 | 1.091 | 0.250 | 0.800 |" in text, text
