"""Probe: does a transfer into a peer's symmetric buffer overlap a cuBLAS GEMM, by mechanism?

Times on 2 GPUs (each rank sends to the other at once): the GEMM alone, each transfer alone,
and GEMM (caller stream) + transfer (high-priority side stream) together, for
copy_ push (peer destination), copy_ pull (peer source), and a Triton copy kernel with a
given number of blocks pushing with NVLink stores.  Prints which kernels/memcpys a copy_
runs as (profiler), so the "copy engine" claim is checked, not assumed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_copy_overlap.py
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.bench_matmul_collectives import _timed_all  # noqa: E402
from torch_commopt.launch import run_distributed  # noqa: E402


def _time(fn) -> float:
    return _timed_all({"fn": fn}, iters=10, repeats=5)["fn"][0]


def probe(rank: int, world: int, m: int = 8192, k: int = 8192, n: int = 4096):
    from torch_commopt.kernels.gpu import symm
    from torch_commopt.kernels.gpu.triton_kernels import copy_rows

    gname = dist.group.WORLD.group_name
    rt = symm.runtime(gname, torch.device("cuda", rank))
    nbytes = m * k * 2
    buf = rt.buffer(2 * nbytes)
    peer = (rank + 1) % world
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    to_peer = buf.view(peer, 0, (m, k), torch.bfloat16)
    from_peer = buf.view(peer, nbytes, (m, k), torch.bfloat16)
    local = buf.view(rank, 0, (m, k), torch.bfloat16)
    side = rt.side
    cur = torch.cuda.current_stream()
    transfers = {
        "copy_ push": lambda: to_peer.copy_(x),
        "copy_ pull": lambda: local.copy_(from_peer),
        "triton push 8 blocks": lambda: copy_rows(x, to_peer, 8),
        "triton push 16 blocks": lambda: copy_rows(x, to_peer, 16),
        "triton push 32 blocks": lambda: copy_rows(x, to_peer, 32),
    }
    rows = {"gemm alone": _time(lambda: torch.mm(a, w))}
    for name, fn in transfers.items():
        rows[f"{name} alone"] = _time(fn)

        def both(fn=fn):
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                fn()
            torch.mm(a, w)
            cur.wait_stream(side)

        rows[f"gemm + {name}"] = _time(both)
    prof_lines = []
    if rank == 0:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            to_peer.copy_(x)
            local.copy_(from_peer)
            torch.cuda.synchronize()
        prof_lines = [f"{e.key}: {e.count} calls" for e in prof.key_averages()]
    return rows, prof_lines


def probe_rs_ce(rank: int, world: int):
    """One fused store=ce matmul_rs in debug mode; returns the error message (if any) and counters."""
    import os

    import torch_commopt  # noqa: F401
    from torch_commopt.kernels.gpu import symm

    os.environ["TORCH_COMMOPT_WAIT_TIMEOUT_S"] = "5"
    gname = dist.group.WORLD.group_name
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    msgs = []
    for sched in ("fused:1:store=ce,dbg=1", "fused:3:store=ce,dbg=1", "fused:2:store=direct,dbg=1"):
        try:
            out = torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gname, sched)
            ref = torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, gname, "sequential")
            msgs.append(f"{sched}: ok err {((out.float() - ref.float()).norm() / ref.float().norm()).item():.2e}")
        except Exception as e:  # report and go on: this is a probe
            rt = symm.runtime(gname, a.device)
            c = rt.flags[symm.COUNTERS: symm.COUNTERS + 2 * symm.MAX_CHUNKS].view(2, -1)[:, :4].tolist()
            d = rt.flags[symm.DATA: symm.DATA + 2 * symm.MAX_CHUNKS].view(2, -1)[:, :4].tolist()
            msgs.append(f"{sched}: {type(e).__name__}: {e}; counters {c}; data {d}; epoch {rt.epoch}")
            break
    return msgs


if __name__ == "__main__":
    for rows, prof in run_distributed(probe, 2, backend="nccl", timeout_s=300)[:1]:
        for name, ms in rows.items():
            print(f"{name:32s} {ms:.3f} ms")
        print("\n".join(prof))
    for r, msgs in enumerate(run_distributed(probe_rs_ce, 2, backend="nccl", timeout_s=200)):
        print(f"rank {r}:", *msgs, sep="\n  ")
