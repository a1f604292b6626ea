"""benchmarks/costmodel_replay.py on the committed runs: every shape is either a top-1 hit or listed
as a miss naming the model's top-1 and the measured best (whatever today's model predicts).
The runs are the current reports in benchmarks/results (one per card and timing mode), found by
name, so a newer run that replaces one is tested the same way."""

import pathlib

from benchmarks import costmodel_replay
from benchmarks.common import RESULTS

# A calibration whose eager factor curves pair a replayed short probe with an eager long one
# (the form test_refit_factors_reproduce_the_probe_times_the_run_measured checks), kept here so
# that the test does not depend on which run benchmarks/results holds.
EAGER_CURVES = pathlib.Path(__file__).resolve().parent / "data" / "costmodel_h100x2_2026-11-26_calibration.json"


def _run(mode: str):
    found = sorted(RESULTS.glob(f"costmodel_h200x2_*_{mode}.json"))
    assert found, f"no committed costmodel_h200x2_*_{mode}.json in {RESULTS}"
    return found[-1]


RUN = _run("cg")


def test_a_stored_run_replays_with_its_misses_named():
    got = costmodel_replay.replay(RUN)
    assert got["run"] == RUN.name.removeprefix("costmodel_").removesuffix(".json") and got["shapes"] == 14
    assert got["top1_within_5pct"] + len(got["misses"]) == got["shapes"]
    for _shape, (top, top_pred, top_meas), (best, best_pred, best_meas) in got["misses"]:
        assert top != best and top_pred <= best_pred and top_meas > 1.05 * best_meas
    assert len({key for key, *_ in got["misses"]}) == len(got["misses"])  # one entry per shape


def test_refit_factors_reproduce_the_probe_times_the_run_measured():
    # a factor curve point is (the model's prediction at the probe, measured / predicted): after
    # the refit, today's model times its new factor must give the same measured probe time
    import json

    from torch_commopt.tuner.calibration import Calibration
    from torch_commopt.tuner.matmul.model import RegionShape, predict
    from torch_commopt.tuner.probe_factors import PROBE_SHAPES, SHORT_PROBE_SHAPES

    cal = Calibration.from_json(json.dumps(json.loads(EAGER_CURVES.read_text())["calibration"]))
    new = costmodel_replay.refit(cal)
    assert set(new.schedule_factor_curve) == set(cal.schedule_factor_curve)
    assert len(cal.schedule_factor_curve) > 30
    for key, points in cal.schedule_factor_curve.items():
        kind, sched = key.split(" ")[0], costmodel_replay._probe_schedule(key)
        measured = sorted(p * f for p, f in points)
        got = []
        for shapes, graphs in ((SHORT_PROBE_SHAPES, True), (PROBE_SHAPES, False)):
            (rows, k), (_, n) = shapes[kind]
            shape = RegionShape(kind, rows, k, (n,), cal.world)
            got.append(predict(shape, sched, new, graphs=graphs).gpu_s)
        assert got == __import__("pytest").approx(measured, rel=1e-6), key
        long_factor = new.schedule_factor_curve[key][1][1]  # the long probe's: the key's plain factor
        assert new.schedule_factor.get(key, long_factor) == long_factor


def test_a_call_graphs_run_replays_its_band_as_ranked(tmp_path):
    # bench_costmodel --call-graphs ranks its band's regions as replayed (record call_graphs):
    # the replay predicts those rows so too, and the others eagerly
    import json

    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.calibration import prior
    from torch_commopt.tuner.matmul.model import predict

    cal = prior("NVIDIA H200", 2)
    records = []
    for m, cg in ((512, True), (16384, False)):
        for cand in ("sequential", "ce_push:1"):
            r = {"op": "ag", "M": m, "K": 8192, "N": 8192, "world": 2, "dtype": "bfloat16", "candidate": cand,
                 "call_graphs": cg, "measured_ms": 1.0}
            shape = costmodel_replay.region_shape(r)
            r["predicted_ms"] = predict(shape, Schedule.parse(cand), cal, graphs=cg).seconds * 1e3
            records.append(r)
    assert records[1]["predicted_ms"] != predict(costmodel_replay.region_shape(records[1]), Schedule("ce_push", 1),
                                                 cal).seconds * 1e3  # the flag matters here
    (tmp_path / "costmodel_x_cg.json").write_text(json.dumps(records))
    summary = tmp_path / "costmodel_x_cg_summary.json"
    summary.write_text(json.dumps({"calibration": json.loads(cal.to_json())}))
    got = costmodel_replay.replay(summary)
    assert got["shapes"] == 2 and got["recomputed_max_diff"] < 1e-9


def test_refit_rederives_the_replay_timed_curve_too():
    # the replay-timed curve: both of its points are graph replays, and after
    # the refit today's replayed prediction times its factor gives the probe times the run measured
    import json

    import pytest

    from torch_commopt.tuner.calibration import Calibration
    from torch_commopt.tuner.matmul.model import RegionShape, factor_key, predict
    from torch_commopt.tuner.probe_factors import PROBE_SHAPES, SHORT_PROBE_SHAPES

    run = _run("graphs")
    cal = Calibration.from_json(json.dumps(json.loads(run.read_text())["calibration"]))
    assert len(cal.schedule_factor_curve_graphs) > 30
    new = costmodel_replay.refit(cal)
    assert set(new.schedule_factor_curve_graphs) == set(cal.schedule_factor_curve_graphs)
    checked = 0
    for key, points in cal.schedule_factor_curve_graphs.items():
        kind, sched = key.split(" ")[0], costmodel_replay._probe_schedule(key)
        if factor_key(kind, sched) != key:
            continue  # a family key: the first probe's copy, checked under its own key
        checked += 1
        got = []
        for shapes in (SHORT_PROBE_SHAPES, PROBE_SHAPES):
            (rows, k), (_, n) = shapes[kind]
            got.append(predict(RegionShape(kind, rows, k, (n,), cal.world), sched, new, graphs=True).gpu_s)
        assert sorted(got) == pytest.approx(sorted(p * f for p, f in points), rel=1e-6), key
    assert checked >= 20
