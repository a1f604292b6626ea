"""The benchmarks' GPU clock figures (benchmarks/gpu_clocks.py) from synthetic nvidia-smi output:
each variant timed in turns gets the samples inside its own steps."""

import datetime

from benchmarks import gpu_clocks


def _line(t: float, gpu: int, mhz: int, watts: float, reasons: int) -> str:
    stamp = datetime.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    return f"{stamp}, {gpu}, {mhz}, {watts}, 0x{reasons:016x}"


def test_samples_are_split_by_the_windows_they_fall_in():
    t0 = 1_800_000_000.0
    c = gpu_clocks.ClockSampler()
    c.out = "\n".join(["timestamp, index, clocks.sm [MHz], power.draw [W], clocks_throttle_reasons.active",
                       _line(t0 + 0.01, 0, 1500, 690.0, 4), _line(t0 + 0.01, 1, 1600, 680.0, 4),
                       _line(t0 + 0.06, 0, 1900, 400.0, 0), "[N/A]",
                       _line(t0 + 0.11, 0, 1700, 700.0, 4)])
    every = c.summary()
    assert every[0]["samples"] == 3 and every[1]["samples"] == 1
    assert every[0]["sm_mhz_min"] == 1500 and every[0]["sm_mhz_max"] == 1900
    got = c.summary({"a": [(t0, t0 + 0.05), (t0 + 0.1, t0 + 0.15)], "b": [(t0 + 0.05, t0 + 0.08)], "c": []})
    assert got["a"][0] == {"samples": 2, "sm_mhz_mean": 1600.0, "sm_mhz_min": 1500.0, "sm_mhz_max": 1700.0,
                           "power_w_mean": 695.0, "power_capped_share": 1.0}
    assert got["a"][1]["samples"] == 1
    assert got["b"] == {0: {"samples": 1, "sm_mhz_mean": 1900.0, "sm_mhz_min": 1900.0, "sm_mhz_max": 1900.0,
                            "power_w_mean": 400.0, "power_capped_share": 0.0}}
    assert got["c"] == {}


def test_sampler_without_nvidia_smi_gives_no_figures(monkeypatch):
    monkeypatch.setattr(gpu_clocks.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(OSError("no nvidia-smi")))
    with gpu_clocks.ClockSampler() as c:
        pass
    assert c.summary() == {} and c.summary({"a": [(0.0, 1.0)]}) == {"a": {}}
