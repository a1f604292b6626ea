"""The benchmarks' clock / energy figures (benchmarks/gpu_clocks.py, bench_e2e's energy lines)
without a GPU: NVML and nvidia-smi missing give no figures, never an error."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_clocks  # noqa: E402


def test_sampler_without_nvml_or_nvidia_smi_gives_no_figures(monkeypatch):
    monkeypatch.setattr(gpu_clocks.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    monkeypatch.setattr(gpu_clocks.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(OSError("no nvidia-smi")))
    assert gpu_clocks.energy_now() == {}
    with gpu_clocks.ClockSampler() as c:
        pass
    assert c.summary() == {} and c.energy_j == {}


def test_summary_joins_energy_and_limit_to_the_samples():
    c = gpu_clocks.ClockSampler()
    c.out = "0, 1500, 690.5, 0x0000000000000004\n1, 1700, 650.0, 0x0000000000000000\n[N/A]\n"
    c.energy_j, c.limits = {0: 12.5}, {0: 700.0, 1: 700.0}
    got = c.summary()
    assert got[0]["energy_j"] == 12.5 and got[0]["power_limit_w"] == 700.0 and got[0]["power_capped_share"] == 1.0
    assert "energy_j" not in got[1] and got[1]["power_capped_share"] == 0.0


def test_energy_lines_compare_each_variant_with_inductor():
    import bench_e2e

    rows = [{"backend": "inductor", "speedup_vs_inductor": 1.0,
             "gpu_clocks": {0: {"energy_j_per_step": 37.0}, 1: {"energy_j_per_step": 36.0}}},
            {"backend": "commopt", "speedup_vs_inductor": 1.04,
             "gpu_clocks": {0: {"energy_j_per_step": 35.0}, 1: {"energy_j_per_step": 35.5}}}]
    lines = bench_e2e.energy_lines(rows)
    assert lines[-1] == "- commopt: 70.50 J, inductor / this 1.035; speedup 1.040"
    assert bench_e2e.energy_lines([{"backend": "inductor", "gpu_clocks": {}}]) == []
