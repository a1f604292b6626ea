"""The tuner on W GPUs: calibration time, the cost model against measurement, autotune's pick,
and what a warm tuner cache adds to a compile.

One run:
1. `calibrate_and_store` on every rank (timed) into a fresh cache directory;
2. for every shape of bench_matmul_collectives' sweep, every candidate the model ranks is
   measured (back-to-back calls in rounds, slowest rank, read as the tuner reads a first call:
   autotune.PAIRED) next to its prediction;
3. autotune's own path (`tuner.autotune.measure_candidates` over the model's top-k and
   sequential, timed separately) picks a schedule, compared with the best of step 2 and judged
   in a head-to-head with it (and the model's top-1), round-paired, with a 95% CI (`judge`);
4. a TP MLP (all-gather -> matmul, matmul -> reduce-scatter) compiled with mode="autotune"
   cold (the first call times), then recompiled with the cache warm, against mode="auto".

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/bench_costmodel.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch_commopt  # noqa: E402,F401
from benchmarks.bench_matmul_collectives import _variants, shapes_for  # noqa: E402
from benchmarks.common import machine_meta, result_stem, write_report  # noqa: E402
from benchmarks.costmodel_vs_bench import region_shape  # noqa: E402
from benchmarks.gpu_clocks import snapshot as gpu_state  # noqa: E402
from torch_commopt.kernels.matmul.gpu.pick import call_graphs_pay  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402
from torch_commopt.tuner.calibration import replayed_as  # noqa: E402
from torch_commopt.tuner.gemm_table import with_gemms  # noqa: E402
from torch_commopt.tuner.matmul.autotune import (  # noqa: E402
    MODEL_TIE,
    PAIRED,
    Readings,
    Timing,
    measure_candidates,
    timed_candidates,
    winner,
)
from torch_commopt.tuner.matmul.model import candidates, rank  # noqa: E402
from torch_commopt.tuner.matmul.rounds import paired_ms, ratio_summary  # noqa: E402

TOP_K = 4  # Config.autotune_top_k's default
DUEL_ROUNDS = 15  # the head-to-head's rounds before its near-tie ones


def _replayed_per_call(op, kind: str):
    """op with each schedule that can run with cg=1 run so (Config.call_graphs's per-call graphs)."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.kernels.gpu.call_graphs import per_call

    return lambda name: op(str(per_call(kind, Schedule.parse(name))))


def ranked_shape(shape, rank_: int, world: int, group_name: str, cal, device, cache_dir: str, graphs: bool,
                 call_graphs: bool):
    """(cal with the shape's GEMMs timed, the model's ranked predictions, the op each candidate
    name runs, whether it runs per-call graphs) of one sweep shape, as the compile pass ranks it."""
    region = region_shape({"op": shape.op, "M": shape.M, "K": shape.K, "N": shape.N, "world": world,
                           "dtype": "bfloat16"})
    (a_shape, w_shapes, _), _, _, _, op, _, _ = _variants(shape, rank_, world, group_name)
    # Config.call_graphs: a band region's eager calls replay per-call graphs, ranked as replayed
    # with the calibration's per-call slowdown (calibration.PER_CALL)
    cg = call_graphs and not graphs and call_graphs_pay(region.kind, a_shape, w_shapes, world, "bfloat16")
    # the candidates' GEMMs timed at their shapes, as the compile pass does (tuner.gemm_table)
    how = replayed_as(graphs, cg)
    cal = with_gemms(cal, region, candidates(region, cal, graphs=how), device, group_name, cache_dir, 300.0,
                     graphs=how)
    preds = rank(region, cal, graphs=how)
    return cal, preds, _replayed_per_call(op, region.kind) if cg else op, cg


def worker(rank_: int, world: int, cache_dir: str, only: str, graphs: bool = False, gemm_shapes=None,
           call_graphs: bool = False, probes_paired: bool = False, order: str = ""):
    from torch_commopt.tuner import calibrate, probe_factors
    from torch_commopt.tuner.calibrate import calibrate_and_store
    from torch_commopt.tuner.matmul import autotune

    if gemm_shapes:  # an A/B of the GEMM fit's samples (--gemm-shapes)
        calibrate.GEMM_SHAPES["cuda"] = gemm_shapes
    probe_factors.PROBES_PAIRED = probes_paired  # (--probes-paired) in every rank's process
    autotune.ORDER = order or autotune.ORDER  # (--order) every measurement's round order

    device = torch.device("cuda", rank_)
    group_name = dist.group.WORLD.group_name
    dist.barrier()
    t0 = time.perf_counter()
    cal = calibrate_and_store(group_name, device, cache_dir)
    calibration_s = time.perf_counter() - t0
    phases = {k: round(v, 2) for k, v in calibrate.LAST_PHASES.items()}
    per_call_stats = dict(probe_factors.LAST_PER_CALL_STATS)  # did the per-call probes replay?
    records, shapes, first = [], [], None
    for shape in shapes_for(world):
        if only and shape.op not in only.split(","):
            continue
        cal, preds, op, cg = ranked_shape(shape, rank_, world, group_name, cal, device, cache_dir, graphs, call_graphs)
        names = [str(p.schedule) for p in preds]
        clocks = {"before": gpu_state(rank_)}
        measured = measure_candidates(op, names, group_name, device, timing=Timing(graphs=graphs))
        clocks["after_sweep"] = gpu_state(rank_)
        base = {"op": shape.op, "M": shape.M, "K": shape.K, "N": shape.N, "world": world, "dtype": "bfloat16",
                "call_graphs": cg}
        for p in preds:
            s = str(p.schedule)
            records.append(dict(base, candidate=s, predicted_ms=p.seconds * 1e3, measured_ms=measured[s],
                                predicted_gpu_ms=p.gpu_s * 1e3, predicted_host_ms=p.host_s * 1e3))
        top = timed_candidates(preds, TOP_K)  # what Config(mode="autotune") times
        tuned_rows: list = []
        tuned = measure_candidates(op, top, group_name, device, timing=Timing(graphs=graphs),
                                   readings=Readings(trace=tuned_rows))  # the tuner's read
        clocks["after_autotune"] = gpu_state(rank_)
        # the two ways of reading one autotune measurement (its near-ties chosen by the tuner's
        # read): each candidate's median, and round-paired ratios
        medians = {c: statistics.median(ms for _, s, ms in tuned_rows if s == c) for c in top}
        by_median = min(medians, key=lambda s: (medians[s], s))
        paired = tuned if PAIRED else paired_ms(tuned_rows, by_median)
        # each read decided as the tuner decides (autotune.winner: the model's top-1 within MODEL_TIE stays)
        picks = {"median": winner(medians, prior=names[0], tie=MODEL_TIE),
                 "paired": winner(paired, prior=names[0], tie=MODEL_TIE)}
        pick = picks[_read()]  # what the tuner runs
        best = min(measured, key=measured.get)
        first = first or (shape, measured, best)
        # Two measurements of near-ties disagree within their spread: where the sweep's best is
        # not autotune's pick or the model's top-1, those meet again, alone, for DUEL_ROUNDS rounds
        # (and a near-tie's extra ones); a pick is judged on that timing, paired by round.
        duel = list(dict.fromkeys([pick, *picks.values(), best, names[0]]))
        duel_rows: list = []
        duel_timing = Timing(graphs=graphs, rounds=DUEL_ROUNDS)
        head = (measure_candidates(op, duel, group_name, device, timing=duel_timing, readings=Readings(trace=duel_rows))
                if len(duel) > 1 else {})
        clocks["after_head_to_head"] = gpu_state(rank_)
        judged = {how: judge(duel_rows, p) for how, p in picks.items()}
        # Does a miss reproduce?  The same head-to-head once more, at once (same candidates, same
        # rounds): a real difference shows in both; one the measurement cannot resolve comes and
        # goes.  Reported beside the judge, never in place of it.
        again_rows: list = []
        if not judged[_read()]["held"]:
            measure_candidates(op, duel, group_name, device, timing=duel_timing, readings=Readings(trace=again_rows))
        shapes.append(dict(base, model_top1=names[0], measured_best=best, measured_best_ms=measured[best],
                           model_top1_measured_ms=measured[names[0]], autotune_candidates=top,
                           autotune_pick=pick, autotune_pick_measured_ms=measured[pick], autotune_timing_ms=tuned,
                           autotune_medians_ms=medians, autotune_paired_ms=paired, autotune_picks=picks,
                           head_to_head_ms=head,
                           judged=judged, judged_again=judge(again_rows, pick) if again_rows else None,
                           trace={"autotune": _rounded(tuned_rows), "head_to_head": _rounded(duel_rows),
                                  "head_to_head_again": _rounded(again_rows)},
                           gpu_state=clocks))
        if rank_ == 0:
            print(f"{shape.op} {shape.M}x{shape.K}x{shape.N}: model {names[0]} ({measured[names[0]]:.3f}), "
                  f"best {best} ({measured[best]:.3f}), autotune {pick} ({measured[pick]:.3f})", flush=True)
        torch.cuda.empty_cache()
    drift, drift_state = _drift(*first, rank_, world, group_name, device, graphs) if first else ({}, None)
    compile_times = _compile_overhead(rank_, world, group_name, cache_dir)
    return {"calibration_s": calibration_s, "calibration_phases_s": phases,
            "calibration_per_call_probe_calls": per_call_stats, "calibration": json.loads(cal.to_json()),
            "records": records,
            "shapes": shapes, "compile": compile_times, "drift": drift,
            "drift_gpu_state": drift_state}


def _read() -> str:
    """The name of the read the tuner runs (autotune.PAIRED, as this module holds it)."""
    return "paired" if PAIRED else "median"


def _rounded(rows: list) -> list:
    return [[r, s, round(ms, 5)] for r, s, ms in rows]


def judge(rows: list, pick: str) -> dict:
    """The pick against every other schedule of a head-to-head: per other schedule, the median
    and 95% confidence interval (order statistics) of pick / other over the rounds timing both
    (a round's samples are milliseconds apart, so clocks moving between rounds cancel).  held:
    no other schedule is faster beyond that interval, i.e. the pick is a measured best, the
    others' differences from it being below what the measurement resolves.  The interval is of
    this measurement: consecutive rounds share the card's state, and two measurements seconds
    apart can differ by ~2% (2x H100)."""
    versus = {}
    for other in dict.fromkeys(s for _, s, _ in rows):
        if other != pick and (summary := ratio_summary(rows, pick, other)):
            versus[other] = summary
    return {"versus": versus, "held": all(v["lo"] <= 1.0 for v in versus.values()),
            "worst_median": max((v["median"] for v in versus.values()), default=1.0)}


def _drift(shape, swept: dict[str, float], best: str, rank_: int, world: int, group_name: str, device,
           graphs: bool) -> tuple[dict, list]:
    """The first shape's sweep best and `sequential` timed again after the whole sweep:
    {schedule: [ms in the sweep, ms now]}.  How far one schedule moves within a run (clocks,
    heat) is the resolution of every "measured best" above (2x H200: the same
    schedule 0.810 ms in the sweep and 0.935 ms in a head-to-head minutes later)."""
    _, _, _, _, op, _, _ = _variants(shape, rank_, world, group_name)
    names = list(dict.fromkeys([best, "sequential"]))
    before = gpu_state(rank_)
    again = measure_candidates(op, names, group_name, device, timing=Timing(graphs=graphs))
    return {s: [swept[s], again[s]] for s in names if s in again and s in swept}, [before, gpu_state(rank_)]


def _compile_overhead(rank_: int, world: int, group_name: str, cache_dir: str) -> dict:
    """Seconds of (compile + first call) of a TP MLP with mode auto, autotune cold, autotune warm."""
    import torch.distributed._functional_collectives as funcol

    torch.manual_seed(rank_)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(4096, 8192 // world, device="cuda", dtype=torch.bfloat16) / 64
    w2 = torch.randn(8192 // world, 4096, device="cuda", dtype=torch.bfloat16) / 64

    def mlp(x, w1, w2):
        h = funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD) @ w1
        return funcol.reduce_scatter_tensor(torch.relu(h) @ w2, "sum", scatter_dim=0, group=dist.group.WORLD)

    want = mlp(x, w1, w2)
    out = {}
    for label, options in (("auto", {}), ("autotune_cold", {"mode": "autotune", "cache_dir": cache_dir + "/mlp"}),
                           ("autotune_warm", {"mode": "autotune", "cache_dir": cache_dir + "/mlp"}),
                           ("auto_again", {})):
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = torch.compile(mlp, backend="commopt", options=options)(x, w1, w2)
        torch.cuda.synchronize()
        spent = time.perf_counter() - t0
        (graph,) = torch_commopt.explain().graphs
        err = float((got.float() - want.float()).norm() / want.float().norm())
        out[label] = {"seconds": spent, "schedules": [r.schedule for r in graph.regions], "rel_err": err,
                      "regions": len(graph.regions), "notes": list(graph.notes)}
    return out


def summarize(result: dict) -> dict:
    recs, shapes = result["records"], result["shapes"]
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in recs]
    top1 = [s["model_top1_measured_ms"] <= 1.05 * s["measured_best_ms"] for s in shapes]
    exact = [s["autotune_pick"] == s["measured_best"] for s in shapes]
    # the pick is the sweep's best, or at least as fast as it when the two are timed alone
    held = [not s.get("head_to_head_ms")
            or s["head_to_head_ms"][s["autotune_pick"]] <= s["head_to_head_ms"][s["measured_best"]] for s in shapes]
    top1_head = [s["head_to_head_ms"][s["model_top1"]] <= 1.05 * min(s["head_to_head_ms"].values())
                 if s["model_top1"] in s.get("head_to_head_ms", {}) else ok for s, ok in zip(shapes, top1)]
    near = [s["autotune_pick_measured_ms"] <= 1.02 * s["measured_best_ms"] for s in shapes]
    how = _read()
    judged = {h: [s["judged"][h]["held"] for s in shapes if "judged" in s] for h in ("median", "paired")}
    again = [s for s in shapes if s.get("judged_again")]
    # The same schedule timed twice (the sweep, then autotune's own pass): how far apart
    # two measurements of one thing land -- the resolution of "the measured best".
    sweep = {(r["op"], r["M"], r["N"], r["candidate"]): r["measured_ms"] for r in recs}
    remeasure = [abs(t - sweep[(s["op"], s["M"], s["N"], c)]) / sweep[(s["op"], s["M"], s["N"], c)]
                 for s in shapes for c, t in s["autotune_timing_ms"].items()]
    gaps = [s["autotune_pick_measured_ms"] / s["measured_best_ms"] - 1 for s in shapes]
    comp = result["compile"]
    regions = max(1, comp["autotune_warm"]["regions"])
    base = min(comp["auto"]["seconds"], comp["auto_again"]["seconds"])
    return {"median_rel_error": statistics.median(errors), "records": len(recs),
            "top1_within_5pct": f"{sum(top1)}/{len(top1)}", "autotune_is_measured_best": f"{sum(exact)}/{len(exact)}",
            "autotune_within_2pct_of_best": f"{sum(near)}/{len(near)}",
            "autotune_best_or_wins_head_to_head": f"{sum(held)}/{len(held)}",
            "top1_within_5pct_head_to_head": f"{sum(top1_head)}/{len(top1_head)}",
            "autotune_pick_max_gap_to_best": max(gaps),
            # the head-to-head, round-paired: the pick is not slower than any other beyond the 95% CI
            "autotune_reads": how,
            "autotune_is_a_measured_best_paired_judge": f"{sum(judged[how])}/{len(judged[how])}",
            "autotune_median_read_is_a_measured_best": f"{sum(judged['median'])}/{len(judged['median'])}",
            "autotune_paired_read_is_a_measured_best": f"{sum(judged['paired'])}/{len(judged['paired'])}",
            # of the tuner's read's misses, how many a second head-to-head found again
            "autotune_judge_misses_reproduced": f"{sum(not s['judged_again']['held'] for s in again)}/{len(again)}",
            "autotune_pick_worst_paired_ratio": max((s["judged"][how]["worst_median"] for s in shapes
                                                     if "judged" in s), default=None),
            "remeasure_spread_median": statistics.median(remeasure), "remeasure_spread_max": max(remeasure),
            "drift_first_shape_max": max((abs(b / a - 1) for a, b in result.get("drift", {}).values()), default=None),
            "calibration_s": result["calibration_s"], "calibration_phases_s": result.get("calibration_phases_s"),
            "calibration_per_call_probe_calls": result.get("calibration_per_call_probe_calls"),
            "warm_cache_compile_overhead_s_per_region": (comp["autotune_warm"]["seconds"] - base) / regions,
            "cold_autotune_overhead_s_per_region": (comp["autotune_cold"]["seconds"] - base) / regions}


def _verdict(shape: dict) -> str:
    """The paired judge's figures for the pick the tuner runs (and the other read's, if it differs)."""
    if "judged" not in shape:
        return "-"
    parts = []
    for how, pick in shape["autotune_picks"].items():
        if how != _read() and pick == shape["autotune_pick"]:
            continue
        parts.append(f"{how} read {pick}: {_versus(shape['judged'][how])}")
    if again := shape.get("judged_again"):
        parts.append(f"again: {_versus(again)}")
    return "; ".join(parts)


def _versus(judged: dict) -> str:
    """A judge's verdict as text: pick / each other, median [95% CI], and whether it held."""
    vs = ", ".join(f"{o} {v['median']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]" for o, v in judged["versus"].items())
    return f"{vs or 'alone'} ({'held' if judged['held'] else 'slower'})"


def report(doc: dict, records: list[dict]) -> str:
    """The dated Markdown report of a run (its summary document and records)."""
    meta, summ = doc["meta"], doc["summary"]
    lines = [f"# Tuner on {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, bf16.", "",
             f"Command: `{meta['command']}`", "", "## Summary", ""]
    lines += [f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summ.items()]
    lines += ["", "## Per shape", "",
              "| op | M | K | N | model top-1 (measured ms) | measured best (ms) | autotune pick (ms in sweep) | "
              "head to head, pick / best [top-1] (ms) | paired judge: pick / each other, median [95% CI] | "
              "autotune timed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["shapes"]:
        head = s.get("head_to_head_ms") or {}
        duel = f"{head[s['autotune_pick']]:.3f} / {head[s['measured_best']]:.3f}" if head else "-"
        if s["model_top1"] in head and s["model_top1"] not in (s["autotune_pick"], s["measured_best"]):
            duel += f" (top-1 {head[s['model_top1']]:.3f})"
        lines.append(f"| {s['op']} | {s['M']} | {s['K']} | {s['N']} | "
                     f"{s['model_top1']} ({s['model_top1_measured_ms']:.3f}) | "
                     f"{s['measured_best']} ({s['measured_best_ms']:.3f}) | {s['autotune_pick']} "
                     f"({s['autotune_pick_measured_ms']:.3f}) | {duel} | {_verdict(s)} | "
                     f"{', '.join(s['autotune_candidates'])} |")
    lines += ["", "## Every candidate: predicted vs measured (ms)", ""]
    for r in records:
        err = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        lines.append(f"- {r['op']} {r['M']}x{r['K']}x{r['N']} `{r['candidate']}`: predicted {r['predicted_ms']:.3f}, "
                     f"measured {r['measured_ms']:.3f} ({err:+.1%})")
    comp = doc["compile"]
    lines += ["", "## Compile + first call of a TP MLP (2 regions), seconds", ""]
    lines += [f"- {k}: {v['seconds']:.3f} s, schedules {v['schedules']}, rel. error {v['rel_err']:.1e}"
              for k, v in comp.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--only", default="")
    parser.add_argument("--commit", default="")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the program is replayed from CUDA graphs: predictions without host cost, timings of "
                             "graph replays (Config.cuda_graphs)")
    parser.add_argument("--call-graphs", action="store_true",
                        help="eager, with Config.call_graphs: the band's regions ranked as replayed and timed with "
                             "cg=1 (per-call graphs)")
    parser.add_argument("--gemm-shapes", dest="gemm_shapes", default="",
                        type=lambda t: [tuple(int(x) for x in shape.split(",")) for shape in t.split(";") if shape],
                        help="m,n,k;m,n,k...: the calibration's GEMM samples instead of calibrate.GEMM_SHAPES "
                             "(an A/B of the GEMM fit)")
    parser.add_argument("--probes-paired", action="store_true",
                        help="the calibration's schedule probes read round-paired (probe_factors.PROBES_PAIRED), "
                             "an A/B against their medians")
    parser.add_argument("--order", choices=("rotate", "shuffle"), default="",
                        help="every measurement's round order (autotune.ORDER; default: its value)")
    parser.add_argument("--report-only", metavar="RUN_JSON",
                        help="rewrite the Markdown report of a finished run from its JSON file")
    args = parser.parse_args()
    if args.report_only:
        run_path = pathlib.Path(args.report_only)
        doc = json.loads(run_path.read_text())
        run_path.with_suffix(".md").write_text(report(doc, doc["records"]))
        return
    cache_dir = tempfile.mkdtemp(prefix="commopt_tuner_")
    per_rank = run_distributed(worker, args.world, cache_dir, args.only, args.cuda_graphs, args.gemm_shapes or None,
                               args.call_graphs, args.probes_paired, args.order, backend="nccl", timeout_s=1200)
    result = per_rank[0]
    from torch_commopt.tuner.matmul import autotune

    meta = machine_meta(torch.cuda.get_device_name(0), args.world, args.commit, order=args.order or autotune.ORDER)
    summary = summarize(result)
    # the timing mode, and an A/B option's name, tell apart reports of different things
    variant = "_".join(v for v in ("graphs" if args.cuda_graphs else "cg" if args.call_graphs else "",
                                     "pp" if args.probes_paired else "", args.order) if v)
    stem = result_stem("costmodel", meta["device"], args.world, meta["date"], variant)
    records = [dict(r, **{k: meta[k] for k in ("device", "torch", "date", "commit")}) for r in result["records"]]
    # one JSON: the summary, the calibration the run measured (costmodel_replay.py re-predicts
    # the records with it) and every record
    doc = {"meta": meta, "summary": summary, "shapes": result["shapes"], "compile": result["compile"],
           "calibration": result["calibration"], "drift": result.get("drift", {}),
           "drift_gpu_state": result.get("drift_gpu_state"), "records": records}
    write_report(args.out, stem, doc, report(doc, result["records"]))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
