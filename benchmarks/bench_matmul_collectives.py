"""AG+GEMM, GEMM+RS and GEMM+AR on W GPUs: every commopt schedule next to the baselines.

One run times, per shape (global M, K, N; bf16): the GEMM alone, the collective alone (NCCL),
NCCL sequential (the op's `sequential` schedule: NCCL collective + cuBLAS), PyTorch async-TP
(`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, symmetric
memory enabled for the group), every commopt GPU schedule, and commopt's pick (the built-in
rule's schedule, timed on its own).  Times: CUDA events around back-to-back calls (at least
`iters`, and at least 10 ms of them), median of `repeats` rounds (variants round-robin within
a round), max over ranks; the fastest and slowest rounds are reported as the spread.  Each
commopt schedule's output is checked against NCCL sequential's before it is timed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/bench_matmul_collectives.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch_commopt  # noqa: E402,F401
from torch_commopt.kernels.gpu.pick import pick  # noqa: E402
from torch_commopt.launch import run_distributed  # noqa: E402


@dataclass(frozen=True)
class Shape:
    op: str  # "ag" (weight column-sharded), "rs" / "ar" (weight row-sharded)
    M: int
    K: int
    N: int


SHAPES = [
    Shape("ag", 8192, 8192, 8192), Shape("ag", 16384, 8192, 8192),
    Shape("ag", 4096, 8192, 28672), Shape("ag", 16384, 8192, 28672),
    Shape("ag", 512, 8192, 8192), Shape("ag", 2048, 8192, 8192),
    Shape("rs", 8192, 8192, 8192), Shape("rs", 16384, 8192, 8192),
    Shape("rs", 4096, 8192, 7168), Shape("rs", 16384, 8192, 7168),
    Shape("rs", 512, 8192, 8192), Shape("rs", 2048, 8192, 8192),
    Shape("ar", 8192, 8192, 8192), Shape("ar", 2048, 8192, 8192),
]
SCHEDULES = {
    "ag": ["local_first", "chunked:2", "ce_push:1", "ce_push:2", "ce_push:4", "fused:1", "fused:4",
           "fused:2:bm=128,bn=128,stages=4"],
    "rs": ["chunked:2", "chunked:4", "ce_push:2", "ce_push:4", "ce_pull:2", "ce_pull:4", "direct:1", "direct:2",
           "direct:4", "fused:2:store=direct"],
    "ar": ["chunked:2", "ce_push:2", "ce_pull:2", "direct:1", "direct:2", "direct:4"],
}
KIND = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar"}


def _timed_all(fns: dict, iters: int, repeats: int, target_ms: float = 10.0) -> dict:
    """{name: [ms per call in each round]}: mean of back-to-back calls, max over ranks.  A variant runs max(iters, target_ms / its time)
    calls per round (short calls are otherwise timed over a fraction of a millisecond), the
    same count on every rank.  Each round times every variant once, in an order shuffled per
    round (the same on every rank), so clock or thermal drift and the previous variant's
    leftovers spread evenly instead of favouring a fixed position."""
    counts = []
    for fn in fns.values():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        counts.append(max(iters, min(400, math.ceil(target_ms / max(start.elapsed_time(end) / 3, 1e-3)))))
    n = torch.tensor(counts, device="cuda")
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    counts = dict(zip(fns, n.tolist()))
    samples = {name: [] for name in fns}
    for round_index in range(repeats):
        order = list(fns)
        random.Random(round_index).shuffle(order)
        for name in order:
            fn = fns[name]
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(counts[name]):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / counts[name])
    # Per round, the slowest rank's time of each variant: a call is done when every rank is.
    t = torch.tensor(list(samples.values()), device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist()))


def _rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item()


def _variants(shape: Shape, rank: int, world: int, group_name: str):
    """(inputs description for pick, gemm fn, comm fn, {name: op fn}, torch async-TP fn or None)."""
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    w_ = world
    if shape.op == "ag":
        shard, w = rnd(shape.M // w_, shape.K), rnd(shape.K, shape.N // w_) / math.sqrt(shape.K)
        full = torch.empty(shape.M, shape.K, device="cuda", dtype=torch.bfloat16)
        op = lambda s: torch.ops.commopt.ag_matmul(shard, [w], [None], 0, w_, group_name, s, False)[0]  # noqa: E731
        gemm = lambda: torch.mm(full, w)  # noqa: E731
        comm = lambda: dist.all_gather_into_tensor(full, shard)  # noqa: E731
        tp = lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [w], 0, group_name, return_A=False)[1][0]  # noqa: E731
        return ([shape.M // w_, shape.K], [[shape.K, shape.N // w_]], 0), gemm, comm, op, tp
    a, w = rnd(shape.M, shape.K // w_), rnd(shape.K // w_, shape.N) / math.sqrt(shape.K)
    t = torch.mm(a, w)
    gemm = lambda: torch.mm(a, w)  # noqa: E731
    if shape.op == "rs":
        part = torch.empty(shape.M // w_, shape.N, device="cuda", dtype=torch.bfloat16)
        op = lambda s: torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", w_, group_name, s)  # noqa: E731
        comm = lambda: dist.reduce_scatter_tensor(part, t)  # noqa: E731
        tp = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group_name)  # noqa: E731
        return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], 0), gemm, comm, op, tp
    op = lambda s: torch.ops.commopt.matmul_ar(a, w, None, "sum", w_, group_name, s)  # noqa: E731
    comm = lambda: dist.all_reduce(t)  # noqa: E731
    return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], None), gemm, comm, op, None


def bench_worker(rank: int, world: int, shapes: list[Shape], iters: int, repeats: int):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group_name = dist.group.WORLD.group_name
    enable_symm_mem_for_group(group_name)
    records = []
    for shape in shapes:
        (a_shape, w_shapes, dim), gemm, comm, op, tp = _variants(shape, rank, world, group_name)
        rec = {"op": shape.op, "M": shape.M, "K": shape.K, "N": shape.N, "world": world, "dtype": "bfloat16"}
        chosen, why = pick(KIND[shape.op], a_shape, w_shapes, dim, world, "bfloat16")
        rec["commopt_schedule"], rec["pick_reason"] = str(chosen), why
        ref = op("sequential")
        rec["errors_vs_nccl"] = {s: _rel(op(s), ref) for s in SCHEDULES[shape.op]}
        fns = {"gemm": gemm, "comm": comm, "nccl_seq": lambda: op("sequential")}
        if tp is not None:
            fns["torch_async_tp"] = tp
        fns.update({f"sched {s}": (lambda s=s: op(s)) for s in SCHEDULES[shape.op]})
        fns["pick"] = lambda: op(str(chosen))
        rounds = _timed_all(fns, iters, repeats)
        ms = {name: statistics.median(v) for name, v in rounds.items()}
        rec["gemm_ms"], rec["comm_ms"], rec["nccl_seq_ms"] = ms["gemm"], ms["comm"], ms["nccl_seq"]
        rec["torch_async_tp_ms"] = ms.get("torch_async_tp")
        rec["schedules"] = {s: ms[f"sched {s}"] for s in SCHEDULES[shape.op]}
        rec["commopt_ms"] = ms["pick"]
        # fastest and slowest round of each timing (max over ranks): the run-to-run spread
        rec["round_range_ms"] = {("commopt" if k == "pick" else k): [min(v), max(v)] for k, v in rounds.items()}
        # Paired: the pick against the best baseline *of the same round*, median over rounds
        # (drift between rounds -- clocks, temperature -- cancels within a round).
        best_in_round = [min(x) for x in zip(*[rounds[k] for k in ("nccl_seq", "torch_async_tp") if k in rounds])]
        rec["paired_speedup_vs_best_baseline"] = statistics.median(b / c for b, c in zip(best_in_round, rounds["pick"]))
        _derive(rec, world)
        records.append(rec)
        if rank == 0:
            print(_row(rec), flush=True)
            print("   ", ", ".join(f"{k} {v:.3f}" for k, v in rec["schedules"].items()), flush=True)
    return records


def _derive(rec: dict, world: int) -> None:
    seq, t = rec["nccl_seq_ms"], rec["commopt_ms"]
    floor = max(rec["gemm_ms"], rec["comm_ms"])
    rec["hidden_fraction"] = (seq - t) / (seq - floor) if seq > floor else None
    best = min(x for x in (seq, rec["torch_async_tp_ms"]) if x is not None)
    rec["speedup_vs_best_baseline"] = best / t
    tp = rec["torch_async_tp_ms"]
    rec["torch_async_tp_hidden_fraction"] = (seq - tp) / (seq - floor) if tp is not None and seq > floor else None
    n_local = rec["N"] // world if rec["op"] == "ag" else rec["N"]
    k_local = rec["K"] if rec["op"] == "ag" else rec["K"] // world
    rec["balanced"] = rec["M"] >= 8192 and (n_local >= 4096 if rec["op"] == "ag" else k_local >= 4096)
    flops = 2 * rec["M"] * rec["K"] * rec["N"] / world
    rec["commopt_tflops"] = flops / (t * 1e-3) / 1e12


def _row(r: dict) -> str:
    tp = "-" if r["torch_async_tp_ms"] is None else f"{r['torch_async_tp_ms']:.3f}"
    hf = "-" if r["hidden_fraction"] is None else f"{r['hidden_fraction']:.2f}"
    return (f"{r['op']:>2} {r['M']:>6} {r['K']:>5} {r['N']:>6} | gemm {r['gemm_ms']:.3f} comm {r['comm_ms']:.3f} "
            f"| nccl {r['nccl_seq_ms']:.3f} tp {tp} | commopt {r['commopt_ms']:.3f} ({r['commopt_schedule']}) "
            f"| hidden {hf} speedup {r['speedup_vs_best_baseline']:.3f} (paired {r['paired_speedup_vs_best_baseline']:.3f})")


def _report(records: list[dict], meta: dict) -> str:
    lines = [f"# matmul + collective on {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, bf16.", "",
             f"Command: `{meta['command']}`", "",
             "| op | M | K | N | GEMM | comm | NCCL seq | torch async-TP | commopt pick | schedule | hidden | "
             "async-TP hidden | speedup vs best | paired speedup | balanced |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for r in records:
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {f(r['gemm_ms'])} | {f(r['comm_ms'])} | "
                     f"{f(r['nccl_seq_ms'])} | {f(r['torch_async_tp_ms'])} | {f(r['commopt_ms'])} | "
                     f"{r['commopt_schedule']} | {f(r['hidden_fraction'])} | {f(r['torch_async_tp_hidden_fraction'])} | "
                     f"{r['speedup_vs_best_baseline']:.3f} | {r['paired_speedup_vs_best_baseline']:.3f} | {r['balanced']} |")
    lines += ["", "Times in ms (mean of back-to-back calls, median of round-robin rounds, max over ranks).",
              "speedup vs best = best baseline median / pick median; paired = median over rounds of "
              "(best baseline in that round / pick in that round).", "",
              "## Spread (fastest..slowest round, ms)", ""]
    for r in records:
        rr = r["round_range_ms"]
        cells = ", ".join(f"{k} {rr[k][0]:.3f}..{rr[k][1]:.3f}" for k in ("nccl_seq", "torch_async_tp", "commopt") if k in rr)
        lines.append(f"- {r['op']} {r['M']}x{r['K']}x{r['N']}: {cells}")
    lines += ["",
              "## Every commopt schedule (ms; relative error vs NCCL sequential)", ""]
    for r in records:
        cells = ", ".join(f"`{s}` {t:.3f} ({r['errors_vs_nccl'][s]:.1e})" for s, t in r["schedules"].items())
        lines.append(f"- {r['op']} {r['M']}x{r['K']}x{r['N']}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated ops (ag,rs,ar) to run")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if not args.only or s.op in args.only.split(",")]
    per_rank = run_distributed(bench_worker, args.world, shapes, args.iters, args.repeats, backend="nccl", timeout_s=1800)
    records = per_rank[0]
    import triton

    date = datetime.date.today().isoformat()
    commit = args.commit or _git_commit()
    meta = {"device": torch.cuda.get_device_name(0), "world": args.world, "date": date, "torch": torch.__version__,
            "triton": triton.__version__, "commit": commit, "host": platform.node(),
            "command": "python3 " + " ".join(sys.argv)}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"matmul_collectives_h200x{args.world}_{date}"
    tagged = [dict(r, device=meta["device"], torch=meta["torch"], triton=meta["triton"], commit=commit, date=date)
              for r in records]
    (out / f"{stem}.json").write_text(json.dumps(tagged, indent=1))
    (out / f"{stem}.md").write_text(_report(records, meta))
    print(_report(records, meta))


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
