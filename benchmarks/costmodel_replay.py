"""Replay stored cost-model runs through the current model code (CPU only, no GPU).

Each committed `costmodel_<card>x<n>_<date>_<mode>.json` holds the calibration its run measured
and every candidate's measured time (an older run's `_summary.json` holds the calibration and
the `.json` beside it the records; both forms are read, so a run taken from git history can be
passed by path).  This re-predicts every record with today's `tuner.model` and that
calibration, and prints per run the median |predicted - measured| / measured and how often the
model's top-1 is within 5% of the sweep's best -- so a model change can be judged on measured
runs before the next GPU run.  A run whose stored predictions the current code no longer
reproduces is flagged (`recomputed` differs from what the run recorded).

    python3 -m benchmarks.costmodel_replay [--misses] [--refit] [--transfer-slowdown X] [costmodel_*.json ...]

--refit also re-derives each run's schedule factors from its probes (a factor curve's points
hold the model's prediction at the probe and measured / predicted, so the probe's measured time
is their product) against today's model, as the calibration would have: a change to the
model's structure is then judged with the factors it would have got, not with factors that
corrected the old structure.  Keys without a curve (no short probe) keep their stored factor.
It also re-fits each run's GEMM with today's `calibrate.fit_gemm`, from the samples the run stored
(`Calibration.gemm_samples`); a run that stored none gets them rebuilt: its own fit at the
calibration shapes times the mean measured / fitted ratio there of the same card's runs that did
store them (leave-one-out over those runs: the rebuilt roofline is within 1% of the one fitted to
the real samples; the card, not the run, sets how the old form misses each shape), and the card's
SM count (SMS) for the fit's occupancy.

Judge a change on runs it was not tuned on: a change fitted to one set of runs can lift their
top-1 count and leave another set's unchanged or lower.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS  # noqa: E402
from benchmarks.costmodel_vs_bench import region_shape  # noqa: E402
from torch_commopt.core.schedule import Schedule  # noqa: E402
from torch_commopt.tuner.calibration import Calibration, replayed_as  # noqa: E402
from torch_commopt.tuner.matmul.model import predict  # noqa: E402


def _probe_schedule(key: str) -> Schedule:
    """The schedule a factor key was probed with: "kind name:S..." itself; a family key
    ("kind name") is a copy of its family's first probe (probe_factors._schedule_factors)."""
    from torch_commopt.tuner.probe_factors import PROBE_SCHEDULES

    kind, sched = key.split(" ")
    if ":" in sched:
        return Schedule.parse(sched)
    return next(Schedule.parse(s) for s in PROBE_SCHEDULES[kind] if Schedule.parse(s).name == sched)


# SM counts of the cards the committed runs used (their calibrations predate GemmFit.sms).
SMS = {"NVIDIA H100 80GB HBM3": 132, "NVIDIA H200": 132}


@functools.cache
def _card_gemm_ratios() -> dict[str, dict[tuple, float]]:
    """{device: {(m, n, k): geometric mean of measured / fitted}} of the bf16 GEMM samples over
    every stored run that kept its samples (the fit each run used then)."""
    logs: dict[str, dict[tuple, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in stored_runs():
        cal = Calibration.from_json(json.dumps(json.loads(path.read_text())["calibration"]))
        for m, n, k, t in cal.gemm_samples.get("bfloat16", ()):
            logs[cal.device][(m, n, k)].append(math.log(t / cal.gemm["bfloat16"].time(m, n, k)))
    return {dev: {shape: math.exp(statistics.fmean(v)) for shape, v in per.items()} for dev, per in logs.items()}


def refit_gemm(cal: Calibration) -> Calibration:
    """`cal` with its GEMM fits re-fitted by today's fit_gemm: from its stored samples, else
    (bf16 only) from samples rebuilt as its own fit times its card's measured / fitted ratios."""
    from torch_commopt.tuner.calibrate import fit_gemm

    gemm = dict(cal.gemm)
    for dtype, fit in cal.gemm.items():
        samples = cal.gemm_samples.get(dtype)
        ratios = _card_gemm_ratios().get(cal.device, {}) if dtype == "bfloat16" else {}
        if not samples and len(ratios) >= 3:
            samples = [(m, n, k, fit.time(m, n, k) * r) for (m, n, k), r in ratios.items()]
        if samples:
            gemm[dtype] = fit_gemm([tuple(s) for s in samples], SMS.get(cal.device, 0))
    return dataclasses.replace(cal, gemm=gemm)


def refit(cal: Calibration) -> Calibration:
    """`cal` with its GEMM re-fitted (refit_gemm) and its schedule factors re-derived against
    today's model from the probe times its factor curves imply (the short probe: a graph
    replay; the long one: eager, and replayed in schedule_factor_curve_graphs).  A factor
    without a curve (runs before the two-point factors) keeps the probe time today's model
    gives with the run's own GEMM fit."""
    from torch_commopt.tuner.matmul.model import RegionShape
    from torch_commopt.tuner.probe_factors import FACTOR_RANGE, PROBE_SHAPES, SHORT_PROBE_SHAPES

    stored = dataclasses.replace(cal, schedule_factor={}, schedule_factor_curve={}, schedule_factor_curve_graphs={})
    cal = refit_gemm(cal)
    bare = dataclasses.replace(cal, schedule_factor={}, schedule_factor_curve={}, schedule_factor_curve_graphs={})
    factors, curves = dict(cal.schedule_factor), {}
    for key in set(factors) - set(cal.schedule_factor_curve):
        kind, sched = key.split(" ")[0], _probe_schedule(key)
        (rows, k), (_, n) = PROBE_SHAPES[kind]
        shape = RegionShape(kind, rows, k, (n,), cal.world, "bfloat16")
        factors[key] *= predict(shape, sched, stored).gpu_s / predict(shape, sched, bare).gpu_s

    def rederived(key: str, points: list[list[float]], long_replayed: bool) -> list[list[float]]:
        """[short, long] points of one curve against today's model (long_replayed: the long
        probe was a graph replay too)."""
        kind, sched = key.split(" ")[0], _probe_schedule(key)
        (short_pred, short_f), (long_pred, long_f) = sorted(points)
        new = []
        for shapes, graphs, measured in ((SHORT_PROBE_SHAPES, True, short_pred * short_f),
                                         (PROBE_SHAPES, long_replayed, long_pred * long_f)):
            (rows, k), (_, n) = shapes[kind]
            pred = predict(RegionShape(kind, rows, k, (n,), cal.world, "bfloat16"), sched, bare, graphs=graphs).gpu_s
            new.append([pred, min(max(measured / pred, FACTOR_RANGE[0]), FACTOR_RANGE[1])])
        return new

    for key, points in cal.schedule_factor_curve.items():
        new = rederived(key, points, False)
        curves[key] = sorted(new)
        if key in factors:
            factors[key] = new[1][1]
    replayed = {key: sorted(rederived(key, points, True)) for key, points in cal.schedule_factor_curve_graphs.items()}
    return dataclasses.replace(cal, schedule_factor=factors, schedule_factor_curve=curves,
                               schedule_factor_curve_graphs=replayed)


def stored_runs(folder: pathlib.Path = RESULTS) -> list[pathlib.Path]:
    """The bench_costmodel runs stored in `folder`: each run's JSON (or an older run's summary)."""
    paths = sorted(folder.glob("costmodel_*.json"))
    older = {p.with_name(p.name.replace("_summary.json", ".json")) for p in paths if p.name.endswith("_summary.json")}
    return [p for p in paths if p not in older]


def run_name(path: pathlib.Path) -> str:
    return path.name.removeprefix("costmodel_").removesuffix(".json").removesuffix("_summary")


def load_run(path: pathlib.Path) -> tuple[dict, list[dict]]:
    """(the run's document with its calibration, its records) of a stored run."""
    doc = json.loads(path.read_text())
    if "records" in doc:
        return doc, doc["records"]
    return doc, json.loads(path.with_name(path.name.replace("_summary.json", ".json")).read_text())


def replay(run_path: pathlib.Path, refit_factors: bool = False, transfer_slowdown: float | None = None) -> dict:
    """{run, median_rel_error, top1_within_5pct, shapes, recomputed_max_diff} of one stored run
    (refit_factors: with its factors re-derived against today's model, `refit`;
    transfer_slowdown: the figure assumed where the run's calibration did not measure it)."""
    doc, records = load_run(run_path)
    cal = Calibration.from_json(json.dumps(doc["calibration"]))
    if transfer_slowdown is not None and "transfer_slowdown" not in doc["calibration"]:
        cal = dataclasses.replace(cal, transfer_slowdown=transfer_slowdown)
    if refit_factors:
        cal = refit(cal)
    replayed = "graphs" in run_name(run_path).split("_")[2:]  # a --cuda-graphs run: card, date, then its mode
    by_shape: dict[tuple, dict[str, tuple[float, float]]] = collections.defaultdict(dict)
    errors, recomputed = [], []
    for r in records:
        shape = region_shape(dict(r, dtype=r.get("dtype", "bfloat16")))
        # a _cg run's band: ranked as replayed, with the per-call slowdown where the run measured it
        graphs = replayed_as(replayed, bool(r.get("call_graphs")))
        ms = predict(shape, Schedule.parse(r["candidate"]), cal, graphs=graphs).seconds * 1e3
        by_shape[(r["op"], r["M"], r["K"], r["N"])][r["candidate"]] = (ms, r["measured_ms"])
        errors.append(abs(ms - r["measured_ms"]) / r["measured_ms"])
        recomputed.append(abs(ms - r["predicted_ms"]) / r["predicted_ms"])
    hits, misses = 0, []
    for key, cands in by_shape.items():
        top = min(cands, key=lambda s: (cands[s][0], s))
        best = min(cands, key=lambda s: (cands[s][1], s))
        if cands[top][1] <= 1.05 * cands[best][1]:
            hits += 1
        else:  # (op, M, K, N), then (name, predicted ms, measured ms) of the model's top-1 and the measured best
            misses.append((key, (top, *cands[top]), (best, *cands[best])))
    return {"run": run_name(run_path),
            "median_rel_error": statistics.median(errors), "top1_within_5pct": hits, "shapes": len(by_shape),
            "recomputed_max_diff": max(recomputed), "misses": misses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=pathlib.Path,
                        help="run files (default: every costmodel_*.json under benchmarks/results)")
    parser.add_argument("--misses", action="store_true",
                        help="also list every shape whose top-1 is not within 5%% of the best, and count them by shape")
    parser.add_argument("--refit", action="store_true",
                        help="re-derive each run's schedule factors from its probes against today's model")
    parser.add_argument("--transfer-slowdown", type=float, default=None,
                        help="assume this Calibration.transfer_slowdown for runs whose calibration did not measure "
                             "it (a hypothesis to judge with --refit, not a measurement)")
    args = parser.parse_args()
    paths = args.runs or stored_runs()
    rows = [replay(p, args.refit, args.transfer_slowdown) for p in paths]
    for r in rows:
        flag = ("" if r["recomputed_max_diff"] < 1e-6
                else f"  (recomputed: up to {r['recomputed_max_diff']:.1%} off the run's own)")
        print(f"{r['run']:34s} median error {r['median_rel_error']:.3f}  top-1 within 5% "
              f"{r['top1_within_5pct']}/{r['shapes']}{flag}")
        for (op, m, k, n), top, best in r["misses"] if args.misses else ():
            print(f"    {op} {m}x{k}x{n}: top-1 {top[0]} measured {top[2]:.3f} (predicted {top[1]:.3f}), "
                  f"best {best[0]} {best[2]:.3f} (predicted {best[1]:.3f})")
    if args.misses:
        count = collections.Counter(f"{op} {m}x{k}x{n}" for r in rows for (op, m, k, n), *_ in r["misses"])
        print("misses by shape:", ", ".join(f"{shape} {c}" for shape, c in count.most_common()))
    hits, shapes = sum(r["top1_within_5pct"] for r in rows), sum(r["shapes"] for r in rows)
    print(json.dumps({"runs": len(rows), "top1_within_5pct": f"{hits}/{shapes}",
                      "median_of_run_medians": statistics.median(r["median_rel_error"] for r in rows)}))


if __name__ == "__main__":
    main()
