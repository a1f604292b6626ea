"""What the GPU-wait watchdog costs (kernels/gpu/watchdog.py): GPU schedules' calls timed with the
watchdog on and off (TORCH_COMMOPT_WATCHDOG), in alternating turns within one run, eager and
replayed from per-call graphs, from a host-bound small shape to a GPU-bound one, and the decode-sized
GEMM + one-shot all-reduce whose kernels bound their own spins (no per-call marks), eager and
replayed from a CUDA graph of the call captured in each mode.

Per case and mode: the GPU time per call (CUDA events around `--calls` back-to-back calls, the
median over `--rounds`, the slowest rank) and the host time per call (the enqueue loop).  On one
GPU the ranks share it (TORCH_COMMOPT_SHARED_DEVICE=1, gloo): the times are of the shared device,
each mode seeing the same contention; on W GPUs, NCCL.

    python3 -m benchmarks.bench_watchdog --out OUT [--world 2] [--rounds 9] [--calls 40]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from benchmarks.common import fmt, machine_meta, result_stem, write_report
from torch_commopt.core import env

# (label, op, schedule, rows per rank, K, N)
CASES = [
    ("ag small eager", "ag", "ce_push:1", 256, 4096, 4096),  # host-bound: a size the rule leaves to NCCL eagerly
    # the smallest eager calls the rule may give a GPU schedule (its timed band, M_global 2048:
    # kernels/matmul/gpu/pick.py), near host-bound
    ("ag band eager", "ag", "ce_push:1", 1024, 8192, 8192),
    ("rs band eager", "rs", "ce_push:1", 1024, 8192, 8192),
    ("ag small replayed", "ag", "ce_push:1:cg=1", 256, 4096, 4096),
    ("ag ce_push", "ag", "ce_push:2", 4096, 4096, 4096),
    ("ag fused", "ag", "fused:2", 4096, 4096, 4096),
    ("rs ce_push", "rs", "ce_push:2", 4096, 4096, 4096),
    ("rs fused", "rs", "fused:2:store=direct", 4096, 4096, 4096),
    ("rs replayed", "rs", "ce_push:2:cg=1", 4096, 4096, 4096),
    ("ar oneshot eager", "ar", "oneshot", 1, 4096, 4096),
    ("ar oneshot replayed", "ar:graph", "oneshot", 1, 4096, 4096),
]
MODES = ("on", "off")


def _call(op: str, a, w, sched: str, group_name: str, world: int):
    import torch

    if op == "ag":
        return torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, group_name, sched, False)[0]
    if op.startswith("ar"):
        return torch.ops.commopt.matmul_ar(a, w, None, "sum", world, group_name, sched)
    return torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, group_name, sched)


def _callers(op: str, a, w, sched: str, group_name: str, world: int) -> dict:
    """mode -> a call: the op itself, or (op "ar:graph") a replay of a CUDA graph of one call
    captured with the watchdog in that mode (what a decode step replays; the low-latency kernels
    take their spin bound when launched, so each mode needs its own capture)."""
    import torch

    callers = {}
    for mode in MODES:
        os.environ[env.WATCHDOG] = "1" if mode == "on" else "0"
        for _ in range(6):  # warm-up in both modes (compiles; the low-latency buffer before a capture)
            _call(op, a, w, sched, group_name, world)
        torch.cuda.synchronize()
        if op.endswith(":graph"):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _call(op, a, w, sched, group_name, world)
            callers[mode] = graph.replay
        else:
            callers[mode] = lambda: _call(op, a, w, sched, group_name, world)
    return callers


def _rank(rank: int, world: int, rounds: int, calls: int, labels: list[str] | None = None):
    import torch
    import torch.distributed as dist

    import torch_commopt  # noqa: F401
    os.environ.pop(env.DEBUG_WAITS, None)
    gn, dev = dist.group.WORLD.group_name, torch.device("cuda", torch.cuda.current_device())
    out = []
    for label, op, sched, m, k, n in CASES:
        if labels and label not in labels:
            continue
        g = torch.Generator(device=dev).manual_seed(100 + rank)
        rows = m * world if op == "rs" else m
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(k, n, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(k)
        callers = _callers(op, a, w, sched, gn, world)
        times = {mode: {"gpu_ms": [], "host_us": []} for mode in MODES}
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                os.environ[env.WATCHDOG] = "1" if mode == "on" else "0"
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    callers[mode]()
                host = time.perf_counter() - t0
                end.record()
                end.synchronize()
                times[mode]["gpu_ms"].append(start.elapsed_time(end) / calls)
                times[mode]["host_us"].append(host / calls * 1e6)
        medians = [statistics.median(times[mode][key]) for mode in MODES for key in ("gpu_ms", "host_us")]
        # the slowest rank (NCCL reduces device tensors only, gloo either)
        t = torch.tensor(medians, dtype=torch.float64, device=dev if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append({"label": label, "op": op, "schedule": sched, "rows_per_rank": m, "k": k, "n": n,
                    "raw": times, "slowest": dict(zip(["on_gpu_ms", "on_host_us", "off_gpu_ms", "off_host_us"],
                                                      t.tolist()))})
    os.environ.pop(env.WATCHDOG, None)
    return out, torch.cuda.get_device_name(dev)


def _paired(raw: dict) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of the per-round on / off GPU-time cost, in %."""
    costs = sorted((on / off - 1) * 100 for on, off in zip(raw["on"]["gpu_ms"], raw["off"]["gpu_ms"]))
    q1, median, q3 = statistics.quantiles(costs, n=4) if len(costs) > 1 else costs * 3
    return q1, median, q3


def _marks_cost(rounds: int, calls: int) -> list[dict]:
    """One GPU, one process (no other rank time-slicing the device): a call modelled as a GEMM and
    the flag-write batch a schedule's call ends with (done_reading), with and without the
    watchdog's marks as GroupRuntime.begin_call / end_call queue them: eager, the call's number
    riding on that last batch into host-mapped memory (no start mark); replayed from a CUDA graph,
    a captured call's start batch of three writes before the GEMM and its end write riding on the
    last batch, the start batch on the call's stream ("serial") or forked onto a stream of its own
    and joined before the end mark ("forked"): what the marks add per call on the GPU, and on the
    host (eager)."""
    import torch

    from torch_commopt.kernels.gpu import driver

    dev = torch.device("cuda", 0)
    torch.zeros(1, device=dev)  # the context current here before the driver's host allocation
    _, marks = driver.host_mapped(64)
    flags = torch.zeros(64, dtype=torch.int32, device=dev)
    begin = driver.batch_params([("write", marks, 7), ("write", marks + 4, 0), ("write", marks + 8, 1)])
    fork, join = driver.event_create(), driver.event_create()
    out = []
    number = [0]
    for m in (256, 4096):
        a = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        stream, side = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)

        def steps(mode: str) -> None:
            for _ in range(calls):
                if mode == "forked":
                    driver.record(fork, stream)
                    driver.wait_event(side, fork)
                    driver.batch_array(side, begin)
                    driver.record(join, side)
                elif mode == "captured":
                    driver.batch_array(stream, begin)
                torch.mm(a, w)
                tail = [("write", flags.data_ptr(), 0), ("write", flags.data_ptr() + 4, 1)]
                if mode == "forked":
                    driver.wait_event(stream, join)
                if mode == "off":
                    driver.batch(stream, tail)
                elif mode == "on":  # eager: the call's number into DONE, riding on the last batch
                    number[0] += 1
                    driver.batch(stream, tail + [("write", marks + 12, 0)], last=number[0])
                else:
                    driver.batch(stream, tail + [("write", marks + 8, 0)])

        graphs = {}
        with torch.cuda.stream(stream):
            for mode in ("on", "off"):
                steps(mode)
            for mode in ("captured", "forked", "off"):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    steps(mode)
                graphs[mode] = g
        torch.cuda.synchronize()
        runs = [("eager", "on"), ("eager", "off"), ("replayed", "captured"), ("replayed", "forked"),
                ("replayed", "off")]
        times = {f"{how} {mode}": [] for how, mode in runs}
        host = {mode: [] for mode in MODES}
        for r in range(rounds):
            for how, mode in (runs if r % 2 == 0 else runs[::-1]):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record()
                    t0 = time.perf_counter()
                    steps(mode) if how == "eager" else graphs[mode].replay()
                    if how == "eager":
                        host[mode].append((time.perf_counter() - t0) / calls * 1e6)
                    end.record()
                end.synchronize()
                times[f"{how} {mode}"].append(start.elapsed_time(end) / calls * 1e3)  # us per call
        med = {k: statistics.median(v) for k, v in times.items()}
        out.append({"gemm": f"{m}x4096x4096 bf16", "raw_us": times, "host_raw_us": host,
                    "eager_on_us": med["eager on"], "eager_off_us": med["eager off"],
                    "replayed_on_us": med["replayed captured"], "replayed_forked_us": med["replayed forked"],
                    "replayed_off_us": med["replayed off"],
                    "host_on_us": statistics.median(host["on"]), "host_off_us": statistics.median(host["off"])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--commit", default="")
    parser.add_argument("--cases", default="", help="comma-separated case labels to run (default: all), e.g. "
                        "'ag small eager' with many --rounds to pin a small call's cost down")
    args = parser.parse_args()
    labels = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in labels if c not in [case[0] for case in CASES]]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {[case[0] for case in CASES]}")

    import torch

    from torch_commopt.kernels.gpu import shared_device
    from torch_commopt.testing.launch import run_distributed

    shared = shared_device.enabled()
    if not shared and torch.cuda.device_count() < args.world:
        raise SystemExit(f"needs {args.world} GPUs, or one with {shared_device.ENV}=1")
    per_rank = run_distributed(_rank, args.world, args.rounds, args.calls, labels, backend="gloo" if shared else "nccl",
                               timeout_s=560)
    cases, device = per_rank[0]
    for i, c in enumerate(cases):  # the paired cost: on / off of the same round (drifts cancel), per rank
        c["paired"] = [_paired(rank_cases[i]["raw"]) for rank_cases, _ in per_rank]
    marks = _marks_cost(args.rounds, 200)  # after the ranks: CUDA initialized here only now
    # a run of some cases keeps a report of its own (the full one stays current)
    variant = "_".join(v for v in ("shared1gpu" if shared else "", "cases" if labels else "") if v)
    meta = machine_meta(device, args.world, args.commit, shared_device=shared, rounds=args.rounds, calls=args.calls)
    lines = [f"# GPU-wait watchdog: cost per call, on vs off ({device}, {args.world} ranks"
             f"{' sharing one GPU' if shared else ''})", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; "
             f"median of {args.rounds} rounds of {args.calls} back-to-back calls, the slowest rank; modes in "
             "alternating order each round.", "",
             "| case | schedule | shape (rows/rank x K x N) | GPU ms on | GPU ms off | GPU cost | paired cost "
             "(quartiles) | host us on | host us off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        s = c["slowest"]
        cost = (s["on_gpu_ms"] / s["off_gpu_ms"] - 1) * 100
        c["gpu_cost_pct"] = cost
        paired = max(c["paired"], key=lambda p: p[1])  # the rank whose median paired cost is largest
        lines.append(f"| {c['label']} | `{c['schedule']}` | {c['rows_per_rank']}x{c['k']}x{c['n']} | "
                     f"{fmt(s['on_gpu_ms'], 4)} | {fmt(s['off_gpu_ms'], 4)} | {cost:+.2f}% | "
                     f"{paired[1]:+.2f}% ({paired[0]:+.2f}..{paired[2]:+.2f}) | "
                     f"{fmt(s['on_host_us'], 1)} | {fmt(s['off_host_us'], 1)} |")
    worst = max(c["gpu_cost_pct"] for c in cases)
    lines += ["", f"Largest GPU-time cost: {worst:+.2f}% (negative: within the noise of the alternating turns).",
              "Paired cost: each round's on / off GPU time (the two modes run back to back, so a drift of the "
              "clocks cancels), the median over rounds and its quartiles, on the rank where that median is largest. "
              "Host time is the enqueue loop's wall time per call (the GPU runs behind it)."]
    if shared:
        lines += ["Ranks sharing one GPU are time-sliced by the device, which sets a floor of about 2 ms per "
                  "call whatever the shape: the GPU columns bound the watchdog's cost, the marks below measure it."]
    lines += ["", "## The marks alone, one process on one GPU", "",
              "A call modelled as a GEMM and the flag-write batch it ends with, with and without the marks, "
              "200 calls back to back; us per call, median of "
              f"{args.rounds} rounds. Eager: the call's number riding on the last batch into host-mapped "
              "memory (no start mark). Replayed: a captured call's batch of three writes before the GEMM "
              "and its end write riding on the last batch, the start batch on the call's stream (serial) or "
              "forked onto a stream of its own and joined before the end mark (forked).", "",
              "| GEMM | eager on | eager off | replayed serial | replayed forked | replayed off | forked cost "
              "| host us on | host us off |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in marks:
        r["forked_cost_pct"] = (r["replayed_forked_us"] / r["replayed_off_us"] - 1) * 100
        lines.append(f"| {r['gemm']} | {fmt(r['eager_on_us'], 2)} | {fmt(r['eager_off_us'], 2)} | "
                     f"{fmt(r['replayed_on_us'], 2)} | {fmt(r['replayed_forked_us'], 2)} | "
                     f"{fmt(r['replayed_off_us'], 2)} | {r['forked_cost_pct']:+.2f}% | {fmt(r['host_on_us'], 1)} | "
                     f"{fmt(r['host_off_us'], 1)} |")
    lines.append("")
    stem = result_stem("watchdog_overhead", device, args.world, variant=variant)
    paths = write_report(args.out, stem, {"meta": meta, "cases": cases, "marks": marks}, "\n".join(lines))
    print("\n".join(lines))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
