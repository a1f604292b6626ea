"""Host-replayed eager calls (kernels/gpu/host_replay.py) on the GPU: each case called on fresh
inputs at fresh addresses, its outputs against float64 truth within the error of NCCL + cuBLAS
(`sequential`) on the same inputs, and against the Python host code's outputs on them."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

from torch_commopt.core import env

# (op, schedule, A shape on this rank, dim, weights' N): an all-gather's shard, a reduce-scatter's or an
# all-reduce's input
CASES = [("ag", "ce_push:1:par=1", (4, 256, 512), 1, (384, 128)),  # batch 4, SP rows: batched GEMMs
         ("ag", "ce_push:2", (512, 512), 0, (640,)),
         ("rs", "ce_pull:2", (4, 512, 256), 1, (512,)),
         ("rs", "direct:1", (1024, 384), 0, (256,)),
         ("rs", "ce_push:1", (4, 256, 512), 1, (384,)),  # the own GEMM, then the partial added (cuBLAS axpy)
         ("ar", "ce_push:1", (512, 512), None, (384,)),
         ("ar", "ce_pull:2", (512, 512), None, (384,)),
         # the sm_90a fused kernels (native launches; the reduce-scatter's barrier carries the epoch)
         ("ag", "fused:1:impl=sm90", (2, 256, 512), 1, (512, 256, 256)),
         ("rs", "fused:1:impl=sm90", (2, 512, 512), 1, (256,))]


def _inputs(op: str, shape, ns, seed: int, rank: int, world: int):
    """(A, weights, float64 truth of this rank's output(s)): every rank's A and weights drawn from
    the same seeds, weights as nn.Linear's (N, K) parameters viewed transposed."""
    def draw(s, sh):
        g = torch.Generator(device="cuda").manual_seed(s)
        return torch.randn(sh, generator=g, device="cuda", dtype=torch.float32)
    k = shape[-1]
    a_all = [draw(seed + 10 * r, shape).bfloat16() for r in range(world)]
    ws_all = [[(draw(seed + 10 * r + 1 + i, (n, k)) / math.sqrt(k)).bfloat16().t() for i, n in enumerate(ns)]
              for r in range(1 if op == "ag" else world)]
    if op == "ag":
        full = torch.cat(a_all, dim=len(shape) - 2)
        return a_all[rank], ws_all[0], [full.double() @ w.double() for w in ws_all[0]]
    total = sum(a.double() @ ws[0].double() for a, ws in zip(a_all, ws_all))
    if op == "ar":
        return a_all[rank], ws_all[rank], [total]
    return a_all[rank], ws_all[rank], [total.chunk(world, dim=len(shape) - 2)[rank]]


def _call(op: str, a, ws, dim: int, sched: str, world: int):
    gn = dist.group.WORLD.group_name
    if op == "ag":
        return torch.ops.commopt.ag_matmul(a, ws, [None] * len(ws), dim, world, gn, sched, False)
    if op == "ar":
        return [torch.ops.commopt.matmul_ar(a, ws[0], None, "sum", world, gn, sched)]
    return [torch.ops.commopt.matmul_rs(a, ws[0], None, dim, "sum", world, gn, sched)]


def _rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def cases() -> list:
    """CASES this GPU runs: the sm_90a kernels' only on sm_90 (elsewhere they fall back to Triton)."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    return [c for c in CASES if hopper or "impl=sm90" not in c[1]]


def run_host_replay(rank: int, world: int, calls: int = 10):
    """[(name, replayed error, reference error, bitwise equal to the Python host code)], this
    rank's host_replay.STATS and the number of cases run."""
    from torch_commopt.kernels.gpu import host_replay

    saved = {k: os.environ.pop(k, None) for k in (env.DEBUG_WAITS,)}  # bounded waits never replay
    results, seed = [], 70000
    try:
        for op, sched, shape, dim, ns in cases():
            for i in range(calls):
                seed += 100
                a, ws, truth = _inputs(op, shape, ns, seed, rank, world)
                torch.empty(1 + 4096 * (i % 3), device="cuda")  # the next allocations elsewhere
                os.environ[env.HOST_REPLAY] = "1"
                got = _call(op, a, ws, dim, sched, world)
                os.environ[env.HOST_REPLAY] = "0"
                python = _call(op, a, ws, dim, sched, world)
                seq = _call(op, a, ws, dim, "sequential", world)
                torch.cuda.synchronize()
                for j, (g, p, s, t) in enumerate(zip(got, python, seq, truth)):
                    results.append((f"{op} {sched} {tuple(shape)} call {i} out {j}", _rel(g, t), _rel(s, t),
                                    torch.equal(g, p)))
    finally:
        os.environ.pop(env.HOST_REPLAY, None)
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    return results, dict(host_replay.STATS), len(cases())
