"""bench_e2e's records and report on synthetic results: the headline step time is the burst's
(steps back to back), the isolated step's figures sit beside it, and the breakdown is per step."""

import pytest

from benchmarks import bench_e2e, render_e2e


def _result(burst_ms: float, isolated_ms: float, losses: list[float]) -> dict:
    return {"losses": losses, "peak_mem_gib": 5.0, "step_ms": burst_ms, "tokens_per_s": 8192 / (burst_ms / 1e3),
            "step_ms_isolated": isolated_ms, "host_enqueue_ms": 20.0, "burst_enqueue_ms": 18.0,
            "breakdown_ms": {"gemm": 28.0, "gpu_busy": 44.0, "gpu_span": 45.0}}


def test_speedups_come_from_the_burst_and_the_isolated_step_each_against_its_own():
    res = {"inductor": _result(51.5, 53.4, [2.0, 1.0]), "inductor+async-TP": _result(51.5, 53.0, [2.0, 1.01]),
           "commopt": _result(49.0, 48.5, [2.0, 1.02]), "skipped one": {"skipped": "no CUDA"}}
    rows = {r["backend"]: r for r in bench_e2e.records(res, {"layers": 4, "seq": 8192, "batch": 1}, 2)}
    assert "skipped one" not in rows
    c = rows["commopt"]
    assert c["speedup_vs_inductor"] == pytest.approx(51.5 / 49.0)
    assert c["isolated_speedup_vs_inductor"] == pytest.approx(53.4 / 48.5)
    assert c["isolated_speedup_vs_inductor+async-TP"] == pytest.approx(53.0 / 48.5)
    assert c["max_loss_rel_diff_vs_inductor"] == pytest.approx(0.02)
    meta = {"device": "X", "world": 2, "date": "d", "torch": "t", "commit": "c", "shape": {}, "steps": 2,
            "repeats": 20, "burst": 5, "profile_steps": 3, "command": "python3 x"}
    text = bench_e2e.report(list(rows.values()), meta)
    assert "| commopt | 49.00 | 167184 | 1.051 | 1.051 | 48.50 (1.101) |" in text
    assert "then 5 steps back to back" in text and "3 steps profiled back to back, from an idle GPU, per step" in text
    assert "host enqueue 20.00 ms (in a burst 18.00 ms per step)" in text
    clocks = {"0": {"samples": 7, "sm_mhz_mean": 1800.0, "sm_mhz_min": 1700.0, "sm_mhz_max": 1900.0,
                    "power_w_mean": 650.0, "power_capped_share": 0.5}}
    res["commopt"]["profile_gpu_clocks"] = clocks
    rows = bench_e2e.records(res, {"layers": 4, "seq": 8192, "batch": 1}, 2)
    text = bench_e2e.report(rows, dict(meta, profile_lead=4))
    assert "3 steps profiled back to back after 4 unprofiled ones, per step" in text
    assert "while the profiled steps (and their lead) ran" in text and "GPU 0 (7) 1800 MHz [1700..1900], 650 W" in text


def test_a_record_without_the_isolated_step_still_reports():
    """Results written before the burst timing (no isolated figures) render with '-'."""
    old = _result(51.0, 0.0, [1.0])
    del old["step_ms_isolated"]
    rows = bench_e2e.records({"inductor": old}, {"layers": 1, "seq": 8, "batch": 1}, 2)
    assert "isolated_speedup_vs_inductor" not in rows[0]
    assert "| inductor | 51.00 |" in bench_e2e.report(rows, {"device": "X", "world": 2, "date": "d", "torch": "t",
                                                           "commit": "c", "shape": {}, "steps": 1,
                                                           "command": "x"})


def test_the_band_decisions_are_reported():
    notes = ["x: picked ce_pull:2 (long GEMM)",
             "graph: est. 6.10 ms of matmuls and attention on the GPU, 4.40 ms of host",
             "y: autotune measured 2 candidates at the first call in 0.26 s; runs sequential (0.349 ms)",
             "z: picked ce_push:1 (est.: host-bound band, but the graph's host runs ahead: ranked by GPU time)",
             "graph: est. 6.10 ms of matmuls and attention on the GPU, 4.40 ms of host"]  # a second layer's
    got = bench_e2e.band_notes(notes)
    assert got == sorted(set(notes[1:]))
    res = {"commopt": dict(_result(49.0, 48.5, [2.0, 1.0]), band_notes=got)}
    rows = bench_e2e.records(res, {"layers": 4, "seq": 8192, "batch": 1}, 2)
    text = bench_e2e.report(rows, {"device": "X", "world": 2, "date": "d", "torch": "t", "commit": "c", "shape": {},
                                   "steps": 2, "command": "x"})
    assert "The host-bound band (commopt: graph estimates, first-call timings):" in text
    assert "- y: autotune measured 2 candidates" in text and "picked ce_pull:2" not in text


def test_the_comm_free_bound_is_reported_as_a_bound():
    """The bound's losses are not compared; each variant's share of the gain it allows is."""
    bound = dict(_result(45.0, 46.0, [2.0, 7.0]), bound=True,
                 comm_free={"replaced all_gather_into_tensor": 16, "replaced reduce_scatter_tensor": 16})
    res = {"inductor": _result(50.0, 52.0, [2.0, 1.0]), "commopt": _result(47.0, 48.0, [2.0, 1.0]),
           bench_e2e.COMM_FREE: bound}
    rows = {r["backend"]: r for r in bench_e2e.records(res, {"layers": 4, "seq": 8192, "batch": 1}, 2)}
    assert "max_loss_rel_diff_vs_inductor" not in rows[bench_e2e.COMM_FREE]
    assert rows["commopt"]["share_of_comm_free_gain"] == pytest.approx(3.0 / 5.0)
    assert rows[bench_e2e.COMM_FREE]["speedup_vs_inductor"] == pytest.approx(50.0 / 45.0)
    text = bench_e2e.report(list(rows.values()), {"device": "X", "world": 2, "date": "d", "torch": "t", "commit": "c",
                                                  "shape": {}, "steps": 2, "command": "x"})
    assert "| inductor comm-free | 45.00 |" in text and "(bound: no communication, losses meaningless) | - |" in text
    assert ("could reach at best: 1.111x inductor. Share of that gain each variant won: inductor 0.00, commopt 0.60."
            in text)


def test_the_step_picture_draws_commopt_above_inductor_from_their_traces(tmp_path, capsys):
    """--timeline: the traced steps that step_profile writes (rank 0, one file per variant) drawn
    one above the other; without a variant's trace, no picture and the reason said."""
    import gzip
    import pathlib

    trace = gzip.decompress((pathlib.Path(__file__).parent / "data" / "moe_a2a_h200x2_trace.json.gz").read_bytes())
    (tmp_path / "commopt_rank0.json").write_bytes(trace)
    assert bench_e2e.timeline_picture(tmp_path, ["inductor", "commopt"], tmp_path, "e2e_x") is None
    assert "inductor_rank0.json" in capsys.readouterr().out
    (tmp_path / "inductor_rank0.json").write_bytes(trace)
    assert bench_e2e.timeline_picture(tmp_path, ["commopt"], tmp_path, "e2e_x") is None  # inductor not run
    name = bench_e2e.timeline_picture(tmp_path, ["inductor", "inductor+async-TP", "commopt"], tmp_path, "e2e_x")
    assert name == "e2e_x_timeline.png"
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (tmp_path / "e2e_x_timeline.html").read_text()
    assert "commopt" in html and "inductor" in html


def test_the_kernels_that_differ_from_the_bounds_are_reported():
    res = {"inductor": _result(50.0, 52.0, [2.0, 1.0]), "commopt": _result(47.0, 48.0, [2.0, 1.0]),
           bench_e2e.COMM_FREE: dict(_result(45.0, 46.0, [2.0, 7.0]), bound=True, comm_free={"replaced x": 1})}
    res["commopt"]["breakdown_ms"] = dict(res["commopt"]["breakdown_ms"], kernels={"silu_bwd": [1.16, 4.0]})
    res[bench_e2e.COMM_FREE]["breakdown_ms"] = dict(res[bench_e2e.COMM_FREE]["breakdown_ms"],
                                                    kernels={"silu_bwd": [0.54, 4.0]})
    rows = bench_e2e.records(res, {"layers": 4, "seq": 8192, "batch": 1}, 2)
    text = bench_e2e.report(rows, {"device": "X", "world": 2, "date": "d", "torch": "t", "commit": "c", "shape": {},
                                   "steps": 2, "command": "x"})
    assert "Kernels whose time differs most from the comm-free bound's" in text
    assert "  - +0.620 ms: silu_bwd (1.160 ms x4 against 0.540 ms x4)" in text
    assert "'kernels'" not in text  # not printed with the categories


def test_a_switched_off_variant_is_compared_with_commopt_round_by_round():
    """'commopt watchdog off' beside commopt: the per-round ratios' median and quartiles (the two
    ran back to back in each round), for the burst and the isolated step."""
    on, off = _result(42.0, 43.0, [2.0, 1.0]), _result(41.0, 42.0, [2.0, 1.0])
    on.update(step_ms_all=[42.0, 41.0, 46.0, 40.4], step_ms_isolated_all=[43.0, 43.0, 43.0, 43.0])
    off.update(step_ms_all=[40.0, 41.0, 40.0, 40.0], step_ms_isolated_all=[43.0, 43.0, 43.0, 43.0])
    rows = bench_e2e.records({"commopt": on, "commopt watchdog off": off}, {"layers": 4, "seq": 2048, "batch": 4}, 2)
    text = bench_e2e.report(rows, {"device": "X", "world": 2, "date": "d", "torch": "t", "commit": "c", "shape": {},
                                   "steps": 2, "command": "x"})
    # ratios +5%, 0%, +15%, +1%: median +3%, not the medians' ratio (41.5 / 40 = +3.75%)
    assert ("- commopt watchdog off (4 rounds): back to back commopt's cost over it +3.00% (+0.25%..+12.50%); "
            "isolated commopt's cost over it +0.00% (+0.00%..+0.00%)") in text


def test_each_variant_is_compared_with_inductor_and_the_bound_round_by_round():
    """Speedups and shares of the bound's gain per round: a drift between rounds cancels."""
    ind, com, bound = _result(50.0, 51.0, [2.0, 1.0]), _result(45.0, 46.0, [2.0, 1.0]), _result(40.0, 41.0, [2.0, 1.0])
    ind.update(step_ms_all=[50.0, 60.0, 50.0], step_ms_isolated_all=[51.0, 51.0, 51.0])
    com.update(step_ms_all=[45.0, 54.0, 48.0], step_ms_isolated_all=[46.0, 46.0, 46.0])
    bound.update(step_ms_all=[40.0, 48.0, 40.0], step_ms_isolated_all=[41.0, 41.0, 41.0], bound=True, comm_free={})
    rows = bench_e2e.records({"inductor": ind, "commopt": com, "inductor comm-free": bound},
                             {"layers": 4, "seq": 2048, "batch": 4}, 2)
    text = "\n".join(render_e2e._paired_lines(rows))
    # per round: speedups 1.111, 1.111, 1.042; shares 0.5, 0.5, 0.2
    assert "- commopt (3 rounds): back to back × inductor 1.111 (1.042..1.111), share of the bound's gain 0.50 " in text
    assert "- inductor comm-free (3 rounds): back to back × inductor 1.250 (1.250..1.250); isolated" in text
    assert "- inductor (" not in text  # nothing to compare it with


def test_every_variant_with_an_environment_is_a_known_commopt_variant():
    # a variant listed only in VARIANT_ENV would be refused by --variants on the device
    assert set(bench_e2e.VARIANT_ENV) <= set(bench_e2e.COMMOPT_OPTIONS)
