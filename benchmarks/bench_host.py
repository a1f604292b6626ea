"""Host cost of one region call: what each schedule of the training step's regions costs the CPU to
enqueue, against NCCL + cuBLAS issued directly (the floor an Inductor graph's own collective and
matmuls come close to).

The regions are a Llama-3-8B-shaped TP + SP layer's forward (bench_e2e's model): q/k/v and
w1/w3 as all-gather + matmuls, wo and w2 as matmul + reduce-scatter, at `--batch` x `--seq`
tokens.  Per region and schedule: the host time per call (perf_counter around `--calls`
back-to-back calls, well inside the launch queue, so the host never waits for the GPU; the
median over `--rounds`, the slowest rank) and the GPU time per call (CUDA events around them),
each GPU schedule twice: queued from its recorded host trace (kernels/gpu/host_replay.py, the
default) and through its Python host code (TORCH_COMMOPT_HOST_REPLAY=0), in alternating rounds.
`--profile N`: cProfile of N replayed calls of each region's PROFILED schedule and of its
`sequential`, the functions with the most own time, so the cost can be placed.  `--shared`: both
ranks on one GPU (kernels/gpu/shared_device.py) where only one is lent: the host's cost only.

    python3 -m benchmarks.bench_host --out OUT [--batch 4 --seq 2048] [--rounds 15] [--calls 10] [--shared]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

from benchmarks.common import fmt, machine_meta, result_stem, write_report
from torch_commopt.core import env

DIM, HEADS, KV_HEADS, HIDDEN, HEAD_DIM = 4096, 32, 8, 14336, 128
AG_SCHEDULES = ("nccl+cublas", "cublas only", "sequential", "ce_push:1", "ce_push:1:par=1", "fused:1",
                "fused:1:impl=sm90")
PROFILED = "fused:1:impl=sm90"  # --profile: this schedule's calls (replayed where it can be) and sequential's
RS_SCHEDULES = ("nccl+cublas", "cublas only", "sequential", "ce_push:1", "ce_pull:2", "direct:1", "fused:1:impl=sm90")


def regions(batch: int, seq: int, world: int) -> list[tuple]:
    """(label, op, input shape, weight shapes (K, N)) of one layer's forward regions on one rank."""
    q, kv, f = HEADS * HEAD_DIM // world, KV_HEADS * HEAD_DIM // world, HIDDEN // world
    return [("qkv", "ag", (batch, seq // world, DIM), [(DIM, q), (DIM, kv), (DIM, kv)]),
            ("wo", "rs", (batch, seq, q), [(q, DIM)]),
            ("w1/w3", "ag", (batch, seq // world, DIM), [(DIM, f), (DIM, f)]),
            ("w2", "rs", (batch, seq, f), [(f, DIM)])]


def _baseline(op: str, a, ws, world: int, group):
    """NCCL + cuBLAS as an Inductor graph issues them: the collective on dim 0, the copy that moves
    the sequence blocks into place, the matmuls (c10d's own calls, no wrappers)."""
    import torch

    b, s, d = a.shape
    if op == "ag":
        buf = a.new_empty(world * b, s, d)
        torch.distributed.all_gather_into_tensor(buf, a, group=group)
        rows = buf.view(world, b, s, d).transpose(0, 1).reshape(b * world * s, d)
        return [torch.mm(rows, w) for w in ws]
    prod = torch.mm(a.view(-1, d), ws[0]).view(b, world, s // world, -1).transpose(0, 1).contiguous()
    out = a.new_empty(b, s // world, prod.shape[-1])
    torch.distributed.reduce_scatter_tensor(out, prod.view(world * b, s // world, -1), group=group)
    return out


def _caller(op: str, sched: str, a, ws, world: int):
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD
    if sched == "nccl+cublas":
        return lambda: _baseline(op, a, ws, world, group)
    if sched == "cublas only":  # the matmuls alone, on rows of the gathered (ag) or the local (rs) size
        rows = a.new_empty(world * a.numel() // a.shape[-1] if op == "ag" else a.numel() // a.shape[-1], a.shape[-1])
        return lambda: [torch.mm(rows, w) for w in ws]
    gn = group.group_name
    if op == "ag":
        return lambda: torch.ops.commopt.ag_matmul(a, ws, [None] * len(ws), 1, world, gn, sched, False)
    return lambda: torch.ops.commopt.matmul_rs(a, ws[0], None, 1, "sum", world, gn, sched)


def _profile(fn, calls: int, top: int = 25) -> list[str]:
    import cProfile
    import pathlib
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [f"{tt / calls * 1e6:8.1f} | {ct / calls * 1e6:8.1f} | {nc / calls:5.1f} | "
            f"{pathlib.Path(f).name}:{line}({name})" for (f, line, name), (_, nc, tt, ct, _) in rows]


MODES = {"replayed": "1", "python": "0"}  # TORCH_COMMOPT_HOST_REPLAY per mode


def _time(fn, rounds: int, calls: int, dev, modes: tuple) -> dict:
    """mode -> (host us per call, GPU ms per call) of each round; the modes in alternating order."""
    import torch
    import torch.distributed as dist

    out = {mode: ([], []) for mode in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            os.environ[env.HOST_REPLAY] = MODES[mode]
            torch.cuda.synchronize(dev)
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[mode][0].append((time.perf_counter() - t0) / calls * 1e6)
            end.record()
            end.synchronize()
            out[mode][1].append(start.elapsed_time(end) / calls)
    os.environ.pop(env.HOST_REPLAY, None)
    return out


def _rank(rank: int, world: int, args: dict):
    import torch
    import torch.distributed as dist

    import torch_commopt  # noqa: F401  (the ops)
    from torch_commopt.kernels.gpu import host_replay

    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for label, op, shape, wshapes in regions(args["batch"], args["seq"], world):
        g = torch.Generator(device=dev).manual_seed(10 + rank)
        a = torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)
        # weights as the graph passes them: the transposed view of an (N, K) parameter
        ws = [(torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(k)).t()
              for k, n in wshapes]
        for sched in (AG_SCHEDULES if op == "ag" else RS_SCHEDULES):
            if args["shared"] and sched == "nccl+cublas":
                continue  # no NCCL between ranks of one GPU
            fn = _caller(op, sched, a, ws, world)
            for _ in range(5):
                fn()
            modes = ("replayed", "python") if _replayable(sched) else ("python",)
            for mode, (host, gpu) in _time(fn, args["rounds"], args["calls"], dev, modes).items():
                med = torch.tensor([statistics.median(host), statistics.median(gpu)], dtype=torch.float64, device=dev)
                dist.all_reduce(med, op=dist.ReduceOp.MAX)
                row = {"region": label, "op": op, "schedule": sched, "mode": mode, "shape": list(shape),
                       "weights": wshapes, "host_us": med[0].item(), "gpu_ms": med[1].item(), "host_us_rounds": host}
                out.append(row)
                if rank == 0:
                    print(f"{label:6s} {sched:18s} {mode:8s} host {row['host_us']:7.1f} us  gpu {row['gpu_ms']:.3f} ms",
                          flush=True)
            if args["profile"] and sched in ("sequential", PROFILED):
                dist.barrier()
                out[-1]["profile"] = _profile(fn, args["profile"])
                torch.cuda.synchronize(dev)
    if rank == 0:
        print(f"host replay {host_replay.STATS}; not replayed: {host_replay.refusals()}", flush=True)
    return out, torch.cuda.get_device_name(dev), host_replay.refusals()


def _replayable(sched: str) -> bool:
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.kernels.gpu import host_replay

    return sched not in ("nccl+cublas", "cublas only") and host_replay.replayable(Schedule.parse(sched))


def markdown(rows: list[dict], meta: dict, args) -> str:
    shared = ("; both ranks on one GPU (shared-device mode: the host's cost is real, the GPU's time is shared "
              "and not reported; NCCL cannot run, so the NCCL + cuBLAS reference is the 2-GPU report's, and "
              "`sequential` waits for gloo's collective on the host)"
              ) if args.shared else ""
    lines = [f"# Host cost per region call ({meta['device']}, {args.world} ranks)", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}; Llama-3-8B-shaped "
             f"TP={args.world} + SP layer forward at batch {args.batch} x seq {args.seq}, bf16; median of "
             f"{args.rounds} rounds of {args.calls} back-to-back calls, the slowest rank{shared}.", "",
             f"Command: `python3 -m benchmarks.bench_host --batch {args.batch} --seq {args.seq} --rounds {args.rounds} "
             f"--calls {args.calls}{' --shared' if args.shared else ''}`", "",
             "| region | schedule | host us / call: replayed | Python host code | replayed vs nccl+cublas | "
             "GPU ms / call (replayed) |", "|---|---|---|---|---|---|"]
    base = {r["region"]: r["host_us"] for r in rows if r["schedule"] == "nccl+cublas"}
    by = {(r["region"], r["schedule"], r["mode"]): r for r in rows}
    for (region, sched, mode), r in by.items():
        if mode == "python" and (region, sched, "replayed") in by:
            continue
        python = by.get((region, sched, "python"), r)
        ratio = f"{r['host_us'] / base[region]:.2f}x" if region in base else "-"
        gpu = "-" if args.shared else fmt(r["gpu_ms"], 3)
        lines.append(f"| {region} | `{sched}` | {fmt(r['host_us'], 1) if mode == 'replayed' else '-'} | "
                     f"{fmt(python['host_us'], 1)} | {ratio} | {gpu} |")
    if meta.get("not_replayed"):
        lines += ["", "Kinds of calls that ran their Python host code (host_replay.refusals):", "",
                  *(f"- {why}" for why in meta["not_replayed"])]
    for r in rows:
        if r.get("profile"):
            lines += ["", f"cProfile, {r['region']} `{r['schedule']}` (rank 0; own us/call | cumulative us/call | "
                      "calls/call | function):", "", "```", *r["profile"], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--profile", type=int, default=0, metavar="CALLS")
    p.add_argument("--commit", default="")
    p.add_argument("--shared", action="store_true",
                   help="every rank on one GPU (kernels/gpu/shared_device.py, gloo): host cost only")
    args = p.parse_args()

    import torch

    from torch_commopt.testing.launch import run_distributed

    if torch.cuda.device_count() < (1 if args.shared else args.world):
        raise SystemExit(f"needs {args.world} GPUs, or --shared and one")
    if args.shared:
        os.environ[env.SHARED_DEVICE] = "1"
    per_rank = run_distributed(_rank, args.world, vars(args), backend="gloo" if args.shared else "nccl",
                               timeout_s=560)
    rows, device, not_replayed = per_rank[0]
    meta = machine_meta(device, 1 if args.shared else args.world, args.commit, batch=args.batch, seq=args.seq,
                        not_replayed=not_replayed)
    stem = result_stem("host", device, 1 if args.shared else args.world)
    write_report(args.out, stem, {"meta": meta, "rows": rows},
                 markdown(rows, meta, args))


if __name__ == "__main__":
    main()
