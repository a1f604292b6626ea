"""Timeline of a few commopt calls on 2 GPUs (torch.profiler chrome traces, one per rank) and
the host time each call takes to enqueue, to see where an overlapped schedule loses time.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/profile_schedules.py OUTDIR [op:M:K:N:schedule ...]

(cases on the command line replace the default ones, e.g. rs:8192:8192:8192:ce_push:2; op mm: the
reduction's local GEMM alone, mm:8192:8192:8192:-)
"""

from __future__ import annotations

import math
import pathlib
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch_commopt  # noqa: E402,F401
from torch_commopt.launch import run_distributed  # noqa: E402

CASES = [("ag", 8192, 8192, 8192, "ce_push:1"), ("ag", 8192, 8192, 8192, "sequential"),
         ("ag", 512, 8192, 8192, "ce_push:1"), ("rs", 8192, 8192, 8192, "direct:1"),
         ("rs", 4096, 8192, 7168, "direct:1"), ("rs", 8192, 8192, 8192, "ce_push:2")]


def _call(op, m, k, n, world, rank, gname):
    g = torch.Generator(device="cuda").manual_seed(rank)
    if op == "ag":
        a = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(k, n // world, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(k)
        return lambda s: torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, gname, s, False)
    a = torch.randn(m, k // world, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(k // world, n, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(k)
    if op == "mm":  # the reduction's whole local GEMM alone (the schedule field is ignored)
        return lambda s: torch.mm(a, w)
    if op == "ar":
        return lambda s: torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gname, s)
    return lambda s: torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gname, s)


def worker(rank, world, out, cases=CASES):
    gname = dist.group.WORLD.group_name
    fns = [(c, _call(*c[:4], world, rank, gname)) for c in cases]
    host = {}
    for c, fn in fns:
        for _ in range(3):
            fn(c[4])
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(c[4])
        host[str(c)] = (time.perf_counter() - t0) / 10 * 1e3
        torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for c, fn in fns:
            dist.barrier()
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"case {c}"):
                for _ in range(3):
                    fn(c[4])
            torch.cuda.synchronize()
    prof.export_chrome_trace(f"{out}/trace_rank{rank}.json")
    return host


def _parse(case: str) -> tuple:
    op, m, k, n, sched = case.split(":", 4)
    return op, int(m), int(k), int(n), sched


if __name__ == "__main__":
    out = sys.argv[1]
    cases = [_parse(c) for c in sys.argv[2:]] or CASES
    for r, host in enumerate(run_distributed(worker, 2, out, cases, backend="nccl", timeout_s=300)):
        for k, v in host.items():
            print(f"rank {r} host enqueue ms/call {v:.3f} {k}")
