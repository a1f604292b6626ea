"""Whole-graph plan vs fixed per-region plans on a compiled TP+SP transformer block (2 GPUs).

One Llama-style block (attention + SwiGLU MLP, DTensor TP with sequence parallelism, bf16) is
compiled once per variant and trained forward + backward:

    inductor            torch.compile's default backend (NCCL collectives + cuBLAS)
    fixed X             backend="commopt", every region runs schedule X (a region whose op has
                        no X, e.g. `direct` for an all-gather, takes the built-in rule: noted)
    rule                the built-in rule (Config default)
    searched            Config(mode="model"): every region's schedule chosen by the cost model
                        and the exact plan search (reshard/plan.py), the same for every rank;
                        the machine is calibrated first (`python -m torch_commopt calibrate`,
                        what the README asks of a user of mode="model")
    searched within B   the same under Config.memory_budget_mib=B (--budget-mib B,...): a budget
                        that binds makes the search mix schedules; the report sets it against
                        the fastest fixed plan whose predicted memory fits B in every graph
                        (and says when the unconstrained searched plan equals a fixed one)
    control: X, no concat-K   (--concat-k-controls) fixed ce_push:1 and searched with
                        Config.concat_k=False: the summed matmuls stay as compiled, so each pair
                        differs only in the concat-K regions (ce_push:1 with the concat copies
                        vs NCCL), where a searched plan can differ from fixed ce_push:1; not
                        counted as fixed plans

Steps are timed back to back (each sample >= 20 ms of steps, median over rounds that visit
the variants in a rotated order, slowest rank); outputs and input gradients are compared with
inductor's (bf16 noise).  Writes plan_<card>x<n>_<date>.json/.md:

    python3 -m benchmarks.bench_plan --out DIR [--commit SHA] [--seq 8192] [--budget-mib 300,600]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import machine_meta, result_stem, write_report  # noqa: E402
from benchmarks.compiled_variants import allow_entries, check_unchanged, compile_counts  # noqa: E402
from benchmarks.step_profile import breakdown, format_idle, split  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402

FIXED = ["sequential", "ce_push:1", "ce_push:2", "direct:1"]
TARGET_S = 0.2  # per sample: ~16 steps of the default block (2 steps a sample spread 11.6-14 ms on 2x H200)


def variants(model: str, budgets: tuple[float, ...] = (),
             concat_k_controls: bool = False) -> dict[str, tuple[str, dict]]:
    out = {"inductor": ("inductor", {})}
    for s in FIXED:
        name, _, chunks = s.partition(":")
        out[f"fixed {s}"] = ("commopt", {"schedule": name, "chunks": int(chunks or 1)})
    out["rule"] = ("commopt", {})
    out["searched"] = ("commopt", {"mode": "model"})
    for b in budgets:  # a binding budget: the search must mix schedules (report: best fixed plan that fits)
        out[f"searched within {b:g} MiB"] = ("commopt", {"mode": "model", "memory_budget_mib": b})
    if model == "tp_block":  # TP without SP: the all-reduce split's layouts (reshard/ar_cost.py)
        out["searched + ar_split by cost"] = ("commopt", {"mode": "model", "ar_split": True})
        out["searched + ar_split always"] = ("commopt", {"mode": "model", "ar_split": True,
                                                         "ar_split_policy": "always"})
    if concat_k_controls:
        out["control: ce_push:1, no concat-K"] = ("commopt", {"schedule": "ce_push", "chunks": 1, "concat_k": False})
        out["control: searched, no concat-K"] = ("commopt", {"mode": "model", "concat_k": False})
    # control: the searched variant compiled once more, last: how far two compiles of one plan
    # measure apart (compile-to-compile and build-order variation of identical graphs)
    out["searched, compiled again"] = ("commopt", {"mode": "model", "cache_dir": None})
    return out


def worker(rank: int, world: int, shape: dict, repeats: int, model_kind: str = "tp_sp_block",
           budgets: tuple[float, ...] = (), concat_k_controls: bool = False) -> dict:
    import torch_commopt
    from torch_commopt.testing.validate import build, rel_err

    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    steps, plans, outs = {}, {}, {}
    todo = variants(model_kind, budgets, concat_k_controls)
    # Every variant compiles the same forward code object and keeps its compiled entry: no
    # torch._dynamo.reset() between them (it dropped the earlier variants' entries, so the
    # timing loop recompiled them, and past Dynamo's recompile limit of 8 the later variants
    # ran uncompiled, eagerly), and a limit above the variant count that fails loudly if it is
    # still hit.
    torch._dynamo.reset()
    allow_entries(len(todo))
    for label, (backend, options) in todo.items():
        torch_commopt.reset_explain()
        model, x = build(model_kind, torch.bfloat16, 0, shape)
        fn = torch.compile(model, backend=backend, **({"options": options} if backend == "commopt" else {}))
        x = x.to(dev).requires_grad_(True)
        probe = torch.randn(fn(x).shape, generator=torch.Generator().manual_seed(1)).to(dev, torch.bfloat16)

        def step(fn=fn, x=x, probe=probe, model=model):
            model.zero_grad(set_to_none=True)
            x.grad = None
            out = fn(x)
            (out * probe).sum().backward()
            return out

        out = step()  # compile (and, for autotune-like first calls, resolve) before timing
        outs[label] = (out.detach().float(), x.grad.detach().float())
        if backend == "commopt":
            graphs = torch_commopt.explain().graphs
            plans[label] = [{"graph": g.graph_kind, "region": r.collective, "kind": r.kind, "schedule": r.schedule,
                             "summary": {k: str(v) for k, v in r.summary.items()},
                             "candidates": g.candidates.get(r.collective, [])} for g in graphs for r in g.regions]
            if label.startswith("searched"):
                plans[f"{label} notes"] = [n for g in graphs for n in g.notes + g.plan]
        steps[label] = step
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    compiled = compile_counts()
    counts = _agreed_counts(steps, sync, dev)
    samples = {k: [] for k in steps}
    names = list(steps)
    for r in range(repeats):
        for label in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(counts[label]):
                steps[label]()
            sync()
            samples[label].append((time.perf_counter() - t0) / counts[label] * 1e3)
    med = torch.tensor([statistics.median(samples[k]) for k in names], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    # one profiled step per variant (every rank runs it: collectives), rank 0's categories kept
    profiled = {k: breakdown(steps[k], sync, k) for k in names} if dev == "cuda" else {}
    check_unchanged(compiled, "bench_plan")
    ref_out, ref_grad = outs["inductor"]
    return {"step_ms": dict(zip(names, med.tolist())),
            "spread_ms": {k: [min(v), max(v)] for k, v in samples.items()},
            "plans": plans,
            "rel_diff_vs_inductor": {k: {"out": rel_err(o, ref_out), "grad_x": rel_err(g, ref_grad)}
                                     for k, (o, g) in outs.items()},
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
            "breakdown_ms": profiled}


def _agreed_counts(steps: dict, sync, dev: str) -> dict[str, int]:
    """Steps per sample (>= TARGET_S each), the same on every rank (MAX over ranks)."""
    counts = []
    for step in steps.values():
        step()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        counts.append(max(1, min(50, int(TARGET_S / max(time.perf_counter() - t0, 1e-6)) + 1)))
    n = torch.tensor(counts, dtype=torch.float64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return dict(zip(steps, (int(c) for c in n.tolist())))


def _schedules(res: dict, label: str) -> list[str]:
    return [p["schedule"] for p in res["plans"].get(label, [])]


def _same_plan(res: dict) -> str | None:
    """The fixed variant whose per-region schedules equal the searched plan's, if any."""
    searched = _schedules(res, "searched")
    return next((k for k in res["plans"] if k.startswith("fixed ") and _schedules(res, k) == searched), None)


def _plan_mib(res: dict, label: str) -> dict[str, float] | None:
    """A variant's predicted extra memory per graph (MiB; the budget holds per graph) from the
    searched variant's candidate rows (same regions), counted as the search counts it under a
    budget (reshard.plan.footprint: each size class of symmetric buffers once, plus the
    largest per-call need); None where a schedule has no row."""
    from torch_commopt.reshard.plan import footprint

    rows = {(p["graph"], p["region"]): p["candidates"] for p in res["plans"].get("searched", [])}
    graphs: dict[str, tuple[dict, dict]] = {}
    for p in res["plans"].get(label, []):
        cands = rows.get((p["graph"], p["region"]), [])
        index = next((i for i, c in enumerate(cands) if c["schedule"] == p["schedule"]), None)
        if index is None:
            return None
        table, choice = graphs.setdefault(p["graph"], ({}, {}))
        table[p["region"]], choice[p["region"]] = cands, index
    return {g: footprint(table, choice) for g, (table, choice) in graphs.items()}


def _budget_rows(res: dict, budgets) -> dict:
    """Per budget: the searched plan's predicted MiB (largest graph), the fixed plans whose every
    graph fits it, and the fastest of those."""
    out = {}
    for b in budgets:
        label = f"searched within {b:g} MiB"
        fitting = [k for k in res["step_ms"] if k.startswith("fixed ")
                   and (m := _plan_mib(res, k)) is not None and max(m.values(), default=0.0) <= b]
        mine = _plan_mib(res, label) or {}
        out[label] = {"budget_mib": b, "searched_mib": max(mine.values(), default=0.0), "fitting": fitting,
                      "best_fitting": min(fitting, key=res["step_ms"].get) if fitting else None}
    return out


def report(res: dict, meta: dict) -> str:
    fixed = {k: v for k, v in res["step_ms"].items() if k.startswith("fixed ")}
    best_fixed = min(fixed, key=fixed.get)
    searched = res["step_ms"]["searched"]
    lines = [f"# Whole-graph plan vs fixed per-region plans on {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, bf16, "
             f"shape {meta['shape']}.", "", f"Command: `{meta['command']}`", "",
             "| variant | step ms (fwd+bwd) | fastest..slowest round | vs inductor | out diff vs inductor |",
             "|---|---|---|---|---|"]
    base = res["step_ms"]["inductor"]
    for k, v in res["step_ms"].items():
        lo, hi = res["spread_ms"][k]
        diff = res["rel_diff_vs_inductor"][k]["out"]
        lines.append(f"| {k} | {v:.3f} | {lo:.3f}..{hi:.3f} | {base / v:.3f} | {diff:.1e} |")
    lines += ["", f"Best fixed plan: {best_fixed} ({fixed[best_fixed]:.3f} ms); searched {searched:.3f} ms: "
              f"{fixed[best_fixed] / searched:.3f}x the best fixed plan."]
    if res.get("plans_equal"):
        lines.append(f"(The searched plan is {res['plans_equal']}'s: same schedule in every region.)")
    again = res["step_ms"].get("searched, compiled again")
    if again:
        apart = abs(again - searched) / min(again, searched)
        lines.append(f"The searched plan compiled a second time: {again:.3f} ms ({apart:.1%} "
                     "from the first compile: how far identical plans measure apart in this run).")
    for with_k, without in (("fixed ce_push:1", "control: ce_push:1, no concat-K"),
                            ("searched", "control: searched, no concat-K")):
        if without in res["step_ms"] and with_k in res["step_ms"]:
            lines.append(f"Concat-K's regions: {with_k} {res['step_ms'][with_k]:.3f} ms with them, "
                         f"{res['step_ms'][without]:.3f} ms without (their sums kept as compiled): "
                         f"{res['step_ms'][without] / res['step_ms'][with_k]:.3f}x.")
    for label, b in res.get("budgets", {}).items():
        best = b["best_fitting"]
        lines.append(f"Within {b['budget_mib']:g} MiB: searched {res['step_ms'][label]:.3f} ms "
                     f"({b['searched_mib']:.0f} MiB predicted); fixed plans that fit: {b['fitting'] or 'none'}"
                     + (f"; the best, {best}, {res['step_ms'][best]:.3f} ms: "
                        f"{res['step_ms'][best] / res['step_ms'][label]:.3f}x" if best else ""))
    if res.get("breakdown_ms"):
        lines += ["", "Device time of one step by kernel category (rank 0, ms; overlapped kernels both count; "
                  "gpu_busy: the union of all kernels and copies over gpu_span):", ""]
        lines += [f"- {k}: {split(v)[0]}" for k, v in res["breakdown_ms"].items()]
        idle = [x for k, v in res["breakdown_ms"].items() for x in format_idle(k, split(v)[1])]
        if idle:
            lines += ["", "Where the device sat idle in that step (rank 0; the kernel before and after each gap):",
                      "", *idle]
        for r, other in enumerate(res.get("breakdown_ms_other_ranks") or [], start=1):
            idle = [x for k, v in other.items() for x in format_idle(k, split(v)[1])]
            if idle:
                lines += ["", f"Rank {r}'s idle gaps in its profiled step:", "", *idle]
    lines += ["", "## Searched plan (per region)", ""]
    for p in res["plans"].get("searched", []):
        lines.append(f"- {p['graph']} {p['region']} ({p['kind']}): {p['schedule']}")
        lines += [f"  - {c['schedule']}: predicted {c['predicted_ms']:.3f} ms"
                  + (f" (device {c['gpu_ms']:.3f}, host {c['host_ms']:.3f})" if "gpu_ms" in c else "")
                  for c in p["candidates"][:6]]
    for key, notes in res["plans"].items():
        if key.endswith(" notes"):
            lines += ["", f"Notes ({key[:-6]}):", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--commit", default="")
    parser.add_argument("--cpu", action="store_true",
                        help="smoke run on gloo (CPU) with a tiny block (the GPU shapes take over 10 minutes there), "
                             "no figures")
    parser.add_argument("--budget-mib", dest="budgets", type=lambda t: tuple(float(x) for x in t.split(",") if x),
                        default=(), help="comma-separated memory budgets (MiB per graph): a 'searched within B MiB' "
                                         "variant each, against the fixed plans whose predicted memory fits")
    parser.add_argument("--model", default="tp_sp_block", choices=["tp_sp_block", "tp_block"],
                        help="tp_block: TP without SP, adds the all-reduce split variants")
    parser.add_argument("--concat-k-controls", dest="concat_k_controls", action="store_true",
                        help="add fixed ce_push:1 and searched with concat-K off (controls, not fixed plans)")
    args = parser.parse_args()
    if args.cpu:  # two heads of head dim 16 per rank, 32 tokens per rank
        args.heads, args.seq = 2 * args.world, 32 * args.world
        args.dim, args.hidden, args.repeats = 16 * args.heads, 32 * args.heads, min(args.repeats, 2)
    shape = {"batch": args.batch, "seq": args.seq, "dim": args.dim, "hidden": args.hidden, "heads": args.heads}
    backend = "gloo" if args.cpu else "nccl"
    from torch_commopt.cli import run_calibration

    figures: dict = {}
    calibration = run_calibration(args.world, backend, values=figures)
    print(calibration, flush=True)
    per_rank = run_distributed(worker, args.world, shape, args.repeats, args.model, args.budgets,
                               args.concat_k_controls, backend=backend, timeout_s=900)
    res = per_rank[0]
    # the other ranks' profiled step: a wait for a peer shows on the rank that waits
    res["breakdown_ms_other_ranks"] = [r["breakdown_ms"] for r in per_rank[1:]]
    res["plans_equal"] = _same_plan(res)
    res["budgets"] = _budget_rows(res, args.budgets)
    res["calibration"] = calibration
    res["calibration_figures"] = figures  # what the plans were predicted with (a calibration varies run to run)
    if args.cpu:
        print(json.dumps(res, indent=1))
        return
    meta = machine_meta(torch.cuda.get_device_name(0), args.world, args.commit, shape=shape, model=args.model)
    fixed = {k: v for k, v in res["step_ms"].items() if k.startswith("fixed ")}
    res["best_fixed"] = min(fixed, key=fixed.get)
    res["searched_vs_best_fixed"] = fixed[res["best_fixed"]] / res["step_ms"]["searched"]
    stem = result_stem("plan", meta["device"], args.world, meta["date"],
                       variant="" if args.model == "tp_sp_block" else args.model)
    write_report(args.out, stem, {**meta, **res}, report(res, meta))
    print(report(res, meta))


if __name__ == "__main__":
    main()
