"""Host (Python) cost of one GPU-schedule call, measured on the CPU with CUDA faked out.

The eager training step loses to its host: each commopt region call spends hundreds of
microseconds of Python before the GPU sees its work (bench_e2e --host-profile).  This probe
runs the real host code of the GPU schedules (`ag_matmul_gpu`, `matmul_rs_gpu`,
`matmul_ar_gpu`) on tiny CPU tensors, with the CUDA pieces replaced by the stand-ins of
tests/kernels/fake_cuda.py (the protocol tests' fakes): stream contexts are no-ops, the
driver's stream memory operations, copies and events are dropped, and the symmetric buffers
are CPU tensors.  What it times is therefore the Python and dispatcher work per call, without the
CUDA launch latencies (a few us per kernel, the same for every variant), so it ranks
host-path changes on any machine; the device figure is profile_host.py / bench_e2e.

    python benchmarks/probe_host_cpu.py [--calls 2000] [--profile CASE]

Prints one JSON line per case: {"case", "us_per_call"}.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pathlib
import pstats
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels")]

from torch_commopt.kernels.gpu import ag_matmul as agm  # noqa: E402
from torch_commopt.kernels.gpu import matmul_reduce as mr  # noqa: E402
from torch_commopt.schedule import Schedule  # noqa: E402
from fake_cuda import fake_runtimes, faked_cuda  # noqa: E402  (tests/kernels: the fakes the protocol tests use)

M, K, N = 16, 16, 16  # global rows, contracted dim, output columns (tiny fp32: the host cost only)


def cases(world: int):
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    a_ag = rnd(1, M // world, K)
    qkv = [rnd(K, N // world) for _ in range(3)]
    a_rs = rnd(1, M, K // world)
    w_rs = rnd(K // world, N)
    s1, s2 = Schedule.parse("ce_push:1"), Schedule.parse("ce_push:2")
    return {
        "ag ce_push:1 3 weights +gathered": lambda: agm.ag_matmul_gpu(a_ag, qkv, [None] * 3, 1, "fake", s1, True),
        "ag ce_push:1 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake", s1, False),
        "ag ce_push:2 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake", s2, False),
        "ag ce_push:1:par=1 1 weight": lambda: agm.ag_matmul_gpu(a_ag, qkv[:1], [None], 1, "fake",
                                                                  Schedule.parse("ce_push:1:par=1"), False),
        "rs ce_push:1": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", s1),
        "rs ce_push:2": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", s2),
        "ar ce_push:1": lambda: mr.matmul_ar_gpu(a_rs, w_rs, None, "sum", "fake", s1),
        **batched_cases(world, rnd),
    }


def batched_cases(world: int, rnd):
    """A training step's picks at batch 4 (bench_e2e 4 x 2048 on 2x H200, session 54): a (B, S, K)
    activation sharded along S, so a rank's rows are a block in every batch element (row blocks
    by batched GEMMs); the forward's q/k/v all-gather keeps the gathered input for the backward."""
    b = 4
    a_ag = rnd(b, M // world, K)
    qkv = [rnd(K, N // world) for _ in range(3)]
    w13 = [rnd(K, N) for _ in range(2)]
    a_rs, w_rs = rnd(b, M, K // world), rnd(K // world, N)
    par, s1, pull2 = Schedule.parse("ce_push:1:par=1"), Schedule.parse("ce_push:1"), Schedule.parse("ce_pull:2")
    return {
        "B4 ag ce_push:1:par=1 3 weights +gathered": lambda: agm.ag_matmul_gpu(a_ag, qkv, [None] * 3, 1, "fake", par,
                                                                               True),
        "B4 ag ce_push:1 2 weights": lambda: agm.ag_matmul_gpu(a_ag, w13, [None] * 2, 1, "fake", s1, False),
        "B4 rs ce_pull:2": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", pull2),
        "B4 rs ce_push:1": lambda: mr.matmul_rs_gpu(a_rs, w_rs, None, 1, "sum", "fake", s1),
    }


def attention_cases(world: int):
    """Ulysses training calls (cp_attention_fwd_keep + cp_attention_bwd_kept) through the
    copy-engine all-to-alls (ce_a2a, its usability check forced), one and two head groups, the
    local attention a stand-in that returns its outputs at once: the schedules' and the
    pipeline's own host work (on the GPU each group-pass also pays ~25 driver calls and cuDNN's
    launch).  Call inside attention_fakes()."""
    from types import SimpleNamespace

    from torch_commopt.attention import schedules

    g = torch.Generator().manual_seed(0)
    b, h, s_loc, d = 1, 4 * world, 8, 16
    q, k, v, dout = (torch.randn(b, h, s_loc, d, generator=g) for _ in range(4))
    group = SimpleNamespace(group_name="fake", size=lambda: world, rank=lambda: 0)

    def step(groups: int):
        def run():
            out, kept = schedules.cp_attention_fwd_keep(q, k, v, schedule="ulysses", causal=True, group=group,
                                                        backend="noop", head_groups=groups)
            schedules.cp_attention_bwd_kept(dout, kept, schedule="ulysses", causal=True, group=group, backend="noop")
        return run
    return {f"ulysses fwd+bwd kept g={n}": step(n) for n in (1, 2)}


def attention_fakes(world: int):
    """What attention_cases needs besides faked_cuda: a local backend `noop`, the all-to-alls by
    ce_a2a on CPU tensors, the group's size and a ring group of one."""
    import contextlib
    from unittest import mock

    from torch_commopt.attention import ce_a2a, comm, local

    def fwd(q, k, v, scale, causal):
        return torch.empty_like(q), q.new_empty(q.shape[:3])

    def bwd(dout, q, k, v, out, lse, scale, causal):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.dict(local._REGISTRY, {"noop": local.LocalBackend("noop", fwd, bwd,
                                                                                     lambda q, k: None, auto=False)}))
    stack.enter_context(mock.patch.object(ce_a2a, "usable", lambda *a, **k: True))
    stack.enter_context(mock.patch.object(ce_a2a, "group_streams", lambda: False))
    stack.enter_context(mock.patch.object(comm, "hybrid_groups", lambda pg, u, r: (pg, None)))
    stack.enter_context(mock.patch.object(comm, "size", lambda group: 1 if group is None else group.size()))
    return stack


def time_case(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--profile", default="", help="a case name: print its cProfile (own time)")
    ap.add_argument("--sort", default="tottime", help="the cProfile order (tottime, cumulative)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch_commopt.attention import ce_a2a

    with faked_cuda(fake_runtimes(args.world, owned=(ce_a2a.PURPOSE,))), attention_fakes(args.world):
        # rank 0's host code; the driver calls are dropped
        table = {**cases(args.world), **attention_cases(args.world)}
        for name, fn in table.items():
            print(json.dumps({"case": name, "world": args.world, "us_per_call": round(time_case(fn, args.calls), 1)}))
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                table[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats(args.sort).print_stats(25)


if __name__ == "__main__":
    main()
