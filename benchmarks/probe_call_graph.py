"""Probe: what one call replayed from its own CUDA graph costs, against the same call eager.

The question behind it (NOTES, sessions 34-35): short eager calls are host-bound (back to back
they take the host's enqueue time, 0.17-0.24 ms a call at two ranks, 0.4-0.7 ms at four),
while the same schedule replayed from a CUDA graph runs at the GPU's pace.  If one call
captured once and replayed per call (same input, weight and output addresses) runs near the
replayed figure back to back, a per-call graph cache in the eager path pays; if the replay's
own launch or the gaps between graphs eat it, it does not.

Per case and rank: eager back-to-back us a call (CUDA events over 200 calls) and enqueue us a
call (host, GPU idle at the start); the same for replays of a one-call graph; the replay's
result against the eager result (max abs difference: same kernels, so 0 expected).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_call_graph.py OUTDIR [--world N]
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch_commopt  # noqa: E402,F401
from torch_commopt.launch import run_distributed  # noqa: E402

CASES = [("rs", 2048, "raw"), ("rs", 2048, "ce_push:1"), ("ar", 2048, "raw"), ("ar", 2048, "ce_push:1"),
         ("ag", 2048, "raw"), ("ag", 2048, "ce_push:1"), ("ag", 512, "raw"), ("ag", 512, "ce_push:1:gemm=whole"),
         ("rs", 512, "ce_push:1"), ("rs", 8192, "ce_push:1"),
         # the same through the op's own per-call graphs (kernels/gpu/call_graphs.py)
         ("rs", 2048, "ce_push:1:cg=1"), ("ar", 2048, "ce_push:1:cg=1"), ("ag", 2048, "ce_push:1:cg=1"),
         ("ag", 512, "ce_push:1:cg=1,gemm=whole"), ("rs", 512, "ce_push:1:cg=1"), ("rs", 8192, "ce_push:1:cg=1")]
K = N = 8192


def _inputs(op, m, world, rank):
    g = torch.Generator(device="cuda").manual_seed(rank)
    rnd = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    if op == "ag":
        return rnd(m // world, K), rnd(K, N // world) / math.sqrt(K)
    return rnd(m, K // world), rnd(K // world, N) / math.sqrt(K)


def _fn(op, world, gname, a, w, sched):
    if op == "ag":
        if sched == "raw":
            def raw_ag():
                gathered = a.new_empty((world * a.shape[0], a.shape[1]))
                dist.all_gather_into_tensor(gathered, a)
                return torch.mm(gathered, w)
            return raw_ag
        return lambda: torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, gname, sched, False)[-1]
    if op == "rs":
        if sched == "raw":
            def raw_rs():
                out = a.new_empty((a.shape[0] // world, w.shape[1]))
                dist.reduce_scatter_tensor(out, torch.mm(a, w))
                return out
            return raw_rs
        return lambda: torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gname, sched)
    if sched == "raw":
        def raw_ar():
            out = torch.mm(a, w)
            dist.all_reduce(out)
            return out
        return raw_ar
    return lambda: torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gname, sched)


def _time(run, calls=200):
    """(back-to-back us a call by CUDA events, enqueue us a call with the GPU idle at the start)"""
    enqueue = []
    for _ in range(3):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            run()
        enqueue.append((time.perf_counter() - t0) / 20 * 1e6)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / calls * 1e3, 1), round(sorted(enqueue)[1], 1)


def worker(rank, world):
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    gname = dist.group.WORLD.group_name
    enable_symm_mem_for_group(gname)
    pool = torch.cuda.graph_pool_handle()
    rows, kept = [], []  # the graphs stay alive: a pool whose last graph is freed can't be reused
    for op, m, sched in CASES:
        a, w = _inputs(op, m, world, rank)
        fn = _fn(op, world, gname, a, w, sched)
        for _ in range(5):
            ref = fn()
        torch.cuda.synchronize()
        eager_b2b, eager_enq = _time(fn)
        graph = torch.cuda.CUDAGraph()
        dist.barrier()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=pool):
            static_out = fn()
        graph.replay()
        torch.cuda.synchronize()
        diff = (static_out.float() - ref.float()).abs().max().item()
        graph_b2b, graph_enq = _time(graph.replay)
        rows.append({"case": f"{op} {m} {sched}", "eager_us": eager_b2b, "eager_enqueue_us": eager_enq,
                     "graph_us": graph_b2b, "graph_enqueue_us": graph_enq, "max_abs_diff": diff})
        kept.append(graph)
    return rows


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    world = int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2
    per_rank = run_distributed(worker, world, backend="nccl", timeout_s=400)
    (out / "call_graph.json").write_text(json.dumps(per_rank, indent=1))
    for i, row in enumerate(per_rank[0]):
        print(json.dumps({"case": row["case"], **{f"rank{r}": {k: v for k, v in rows[i].items() if k != "case"}
                                                  for r, rows in enumerate(per_rank)}}))
