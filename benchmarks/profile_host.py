"""Host time of one commopt call per schedule on short shapes, and where it goes (cProfile).

Short GEMMs are host-bound: back-to-back calls take max(GPU time, host time).  This prints
the enqueue time per call (the GPU is idle at the start of each timed batch, so the loop
measures the host) and writes each rank's cProfile of every case, sorted by own time.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/profile_host.py OUTDIR
    python3 benchmarks/profile_host.py OUTDIR --series 40   # per-round series instead
    python3 benchmarks/profile_host.py OUTDIR --world 4     # over 4 GPUs (default 2)

--series R: the band's question over time -- R rounds, each timing every variant of the
reductions at M_global 2048 once (10 back-to-back calls, in an order rotated per round, as
bench_matmul_collectives does), recording each rank's enqueue time and the batch's CUDA-event
time, so slow rounds can be told apart: host (enqueue near the batch time) or GPU-side waits.
"""

from __future__ import annotations

import cProfile
import io
import json
import math
import pathlib
import pstats
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch_commopt  # noqa: E402,F401
from torch_commopt.launch import run_distributed  # noqa: E402

# "raw": the bare `dist` collective + torch.mm a user would write (the benchmark's baseline)
CASES = [("rs", 2048, s) for s in ("raw", "ce_push:1", "direct:1", "ce_push:2")] + [("ag", 2048, s) for s in ("raw", "ce_push:1")]
K = N = 8192


def _call(op, m, world, rank, gname):
    g = torch.Generator(device="cuda").manual_seed(rank)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    if op == "ag":
        a, w = rnd(m // world, K), rnd(K, N // world) / math.sqrt(K)
        return lambda s: _raw_ag(a, w, world) if s == "raw" else torch.ops.commopt.ag_matmul(
            a, [w], [None], 0, world, gname, s, False)
    a, w = rnd(m, K // world), rnd(K // world, N) / math.sqrt(K)
    if op == "rs":
        return lambda s: _raw_rs(a, w, world) if s == "raw" else torch.ops.commopt.matmul_rs(
            a, w, None, 0, "sum", world, gname, s)
    return lambda s: _raw_ar(a, w) if s == "raw" else torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gname, s)


def _raw_ag(a, w, world):
    gathered = a.new_empty((world * a.shape[0], a.shape[1]))
    dist.all_gather_into_tensor(gathered, a)
    return torch.mm(gathered, w)


def _raw_rs(a, w, world):
    out = a.new_empty((a.shape[0] // world, w.shape[1]))
    dist.reduce_scatter_tensor(out, torch.mm(a, w))
    return out


def _raw_ar(a, w):
    out = torch.mm(a, w)
    dist.all_reduce(out)
    return out


def worker(rank, world, out):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    gname = dist.group.WORLD.group_name
    enable_symm_mem_for_group(gname)
    result, profiles = {}, []
    for op, m, sched in CASES:
        fn = _call(op, m, world, rank, gname)
        for _ in range(5):
            fn(sched)
        torch.cuda.synchronize()
        enqueue = []
        for _ in range(5):
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn(sched)
            enqueue.append((time.perf_counter() - t0) / 20 * 1e6)
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        for _ in range(200):
            fn(sched)
        end.record()
        end.synchronize()
        key = f"{op} {m} {sched}"
        result[key] = {"enqueue_us": sorted(enqueue)[len(enqueue) // 2], "back_to_back_us": start.elapsed_time(end) / 200 * 1e3}
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for _ in range(50):
            fn(sched)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        profiles.append(f"===== rank {rank}: {key} =====\n{text.getvalue()}")
    (pathlib.Path(out) / f"cprofile_rank{rank}.txt").write_text("\n".join(profiles))
    return result


SERIES = [("rs", 2048, s) for s in ("raw", "sequential", "ce_push:1", "direct:1")] + \
    [("ar", 2048, s) for s in ("raw", "sequential", "ce_push:1")]


def series_worker(rank, world, rounds):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    gname = dist.group.WORLD.group_name
    enable_symm_mem_for_group(gname)
    fns = {(op, m): _call(op, m, world, rank, gname) for op, m, _ in SERIES}
    for op, m, sched in SERIES:
        for _ in range(5):
            fns[op, m](sched)
    torch.cuda.synchronize()
    rows = []
    for r in range(rounds):
        order = SERIES[r % len(SERIES):] + SERIES[:r % len(SERIES)]
        for op, m, sched in order:
            fn = fns[op, m]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            for _ in range(10):
                fn(sched)
            end.record()
            enqueue = (time.perf_counter() - t0) / 10 * 1e6
            end.synchronize()
            rows.append({"round": r, "case": f"{op} {m} {sched}", "enqueue_us": round(enqueue, 1),
                         "batch_us": round(start.elapsed_time(end) / 10 * 1e3, 1)})
    return rows


def print_series(per_rank) -> None:
    cases = list(dict.fromkeys(row["case"] for row in per_rank[0]))
    for case in cases:
        mine = [[row for row in rows if row["case"] == case] for rows in per_rank]
        batch = sorted(max(rs[i]["batch_us"] for rs in mine) for i in range(len(mine[0])))
        print(json.dumps({"case": case, "batch_us_median_slowest_rank": batch[len(batch) // 2],
                          "batch_us_range": [batch[0], batch[-1]],
                          "per_round": [[(rs[i]["enqueue_us"], rs[i]["batch_us"]) for rs in mine]
                                        for i in range(len(mine[0]))]}))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2
    if "--series" in sys.argv:
        rounds = int(sys.argv[sys.argv.index("--series") + 1])
        per_rank = run_distributed(series_worker, world, rounds, backend="nccl", timeout_s=300)
        (out / "host_series.json").write_text(json.dumps(per_rank))
        print_series(per_rank)
        sys.exit(0)
    per_rank = run_distributed(worker, world, str(out), backend="nccl", timeout_s=300)
    (out / "host_profile.json").write_text(json.dumps(per_rank, indent=1))
    for key in per_rank[0]:
        print(f"{key:40s} " + "  ".join(f"rank{r}: enqueue {res[key]['enqueue_us']:6.1f} us, back-to-back {res[key]['back_to_back_us']:6.1f} us"
                                         for r, res in enumerate(per_rank)))
