"""Per-rank programs checking the GPU schedules' float8 products (torch._scaled_mm, tensor-wise
scales; kernels/scaled.py) against their reference twins and NCCL + _scaled_mm.

As in kernel_cases: every rank draws the same global tensors from a shared seed (fresh per
case), the truth is float64 of the dequantized operands, and a schedule passes within the
tolerance of the worse of its twin's and NCCL sequential's errors.  Schedules without a
float8 product (fused, ce_pull) must refuse it and run NCCL + _scaled_mm instead: they are
checked the same way (their result is sequential's)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from kernel_cases import _compare, _poison, _rel

import torch_commopt  # noqa: F401  (registers the ops)
from torch_commopt.core.schedule import Schedule

FP8 = torch.float8_e4m3fn
AG_SCHEDULES = ["local_first", "ce_push:1", "ce_push:3", "ce_push:1:par=1", "ce_push:2:gemm=whole", "fused:1"]
RS_SCHEDULES = ["ce_push:1", "ce_push:3", "direct:1", "direct:2", "ce_pull:2", "fused:2:store=direct"]
AR_SCHEDULES = ["ce_push:2", "direct:1", "ce_pull:2"]
# (shard shape, gather dim, weight widths, bias, out dtype, fast accumulation)
AG_CASES = [
    ((1024, 1024), 0, [1024, 512], False, torch.bfloat16, True),   # M_global 2048, w1/w3-like
    ((136, 512), 0, [384], True, torch.bfloat16, False),           # rows no tile multiple, bias
    ((2, 96, 256), 1, [320, 64, 64], False, torch.float16, True),   # 3-D, gather dim 1, q/k/v-like
]
# (A shape, scatter dim, N, out dtype, reduce op)
RS_CASES = [((2048, 1024), 0, 1024, torch.bfloat16, "sum"), ((2, 192, 256), 1, 320, torch.bfloat16, "avg"),
            ((1000, 512), 0, 384, torch.float32, "sum")]
AR_CASES = [((256, 512), 384, torch.bfloat16), ((1000, 512), 128, torch.float32)]


def _draw(seed: int, shape, scale_to: float = 1.0):
    """(float8 tensor, its tensor-wise fp32 scale): amax scaling of a fresh normal tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * scale_to
    scale = (x.abs().max() / torch.finfo(FP8).max).float()
    return (x / scale).to(FP8), scale


def _dq(q, scale):
    return q.double() * scale.double()


def _weight(seed: int, k: int, n: int):
    w, s = _draw(seed, (n, k), 1.0 / k ** 0.5)
    return w.t(), s  # column-major, as _scaled_mm takes B


def _ag_case(case, schedules, seed, rank, world):
    shard_shape, dim, ns, bias, out_dtype, fast = case
    gshape = list(shard_shape)
    gshape[dim] *= world
    full, sa = _draw(seed, gshape)
    shard = full.chunk(world, dim=dim)[rank].contiguous()
    k = shard_shape[-1]
    wts = [_weight(seed + 1 + i, k, n) for i, n in enumerate(ns)]
    bs = [torch.randn(n, device="cuda").to(out_dtype) if bias else None for n in ns]
    truth = [_dq(full, sa) @ _dq(w, s) + (b.double() if b is not None else 0) for (w, s), b in zip(wts, bs)]

    def run(sched):
        _poison(sum(t.numel() for t in truth) * 2)
        return torch.ops.commopt.ag_matmul(shard, [w for w, _ in wts], bs, dim, world, dist.group.WORLD.group_name,
                                           sched, False, sa, [s for _, s in wts], out_dtype, fast)

    def error(sched):
        outs = run(sched)
        assert all(o.dtype == out_dtype for o in outs), [o.dtype for o in outs]
        return max(_rel(o, t) for o, t in zip(outs, truth))

    return _compare(f"float8 ag {shard_shape} dim{dim} n{ns} {out_dtype}", error, schedules)


def _reduce_case(kind, a_shape, dim, n, out_dtype, op, schedules, seed, rank, world):
    k = a_shape[-1]
    drawn = [_draw(seed + 100 * r, a_shape, 1.0 + r) for r in range(world)]
    wts = [_weight(seed + 100 * r + 1, k, n) for r in range(world)]
    total = sum(_dq(a, sa) @ _dq(w, sw) for (a, sa), (w, sw) in zip(drawn, wts))
    if op == "avg":
        total = total / world
    truth = total.chunk(world, dim=dim)[rank] if kind == "rs" else total
    (a, sa), (w, sw) = drawn[rank], wts[rank]
    group = dist.group.WORLD.group_name

    def run(sched):
        _poison(total.numel() * 4)
        if kind == "rs":
            return torch.ops.commopt.matmul_rs(a, w, None, dim, op, world, group, sched, sa, sw, out_dtype, True)
        return torch.ops.commopt.matmul_ar(a, w, None, op, world, group, sched, sa, sw, out_dtype, True)

    def error(sched):
        out = run(sched)
        assert out.dtype == out_dtype, out.dtype
        return _rel(out, truth)

    return _compare(f"float8 {kind} {a_shape} dim{dim} n{n} {op} {out_dtype}", error, schedules)


def run_float8_cases(rank: int, world: int):
    """[(name, error, reference error)] for every op x case x schedule."""
    results, seed = [], 9000
    for case in AG_CASES:
        seed += 17
        results += _ag_case(case, AG_SCHEDULES, seed, rank, world)
    for a_shape, dim, n, out_dtype, op in RS_CASES:
        seed += 17
        if (list(a_shape[:-1]) + [n])[dim] % world == 0:
            results += _reduce_case("rs", a_shape, dim, n, out_dtype, op, RS_SCHEDULES, seed, rank, world)
    for a_shape, n, out_dtype in AR_CASES:
        seed += 17
        results += _reduce_case("ar", a_shape, None, n, out_dtype, "sum", AR_SCHEDULES, seed, rank, world)
    return results


REPLAY_CASES = [("ag", "ce_push:1"), ("ag", "ce_push:1:par=1"), ("ag", "ce_push:1:gemm=whole"), ("rs", "ce_push:1"),
                ("rs", "direct:1"), ("ar", "ce_push:2")]


def _replay_inputs(op, seed, rank, world, m=256, k=512, n=384):
    """(A, its scale, B, its scale, float64 truth) of one call: AG shards one global A (one
    scale), RS / AR sum every rank's own product."""
    if op == "ag":
        full, sa = _draw(seed, (world * m, k))
        w, sw = _weight(seed + 1, k, n)
        return full.chunk(world)[rank].contiguous(), sa, w, sw, _dq(full, sa) @ _dq(w, sw)
    drawn = [_draw(seed + 100 * r, (world * m, k), 1.0 + r) for r in range(world)]
    wts = [_weight(seed + 100 * r + 1, k, n) for r in range(world)]
    total = sum(_dq(a, sa) @ _dq(w, sw) for (a, sa), (w, sw) in zip(drawn, wts))
    (a, sa), (w, sw) = drawn[rank], wts[rank]
    return a, sa, w, sw, (total.chunk(world)[rank] if op == "rs" else total)


def _call(op, a, sa, w, sw, sched):
    g, world, bf = dist.group.WORLD.group_name, dist.get_world_size(), torch.bfloat16
    if op == "ag":
        return torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, g, sched, False, sa, [sw], bf, True)[0]
    if op == "rs":
        return torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, g, sched, sa, sw, bf, True)
    return torch.ops.commopt.matmul_ar(a, w, None, "sum", world, g, sched, sa, sw, bf, True)


def run_float8_replays(rank: int, world: int, calls: int = 6):
    """Float8 calls replayed: (1) one call captured in a CUDA graph, replayed on fresh inputs
    and scales copied into the captured ones; (2) eager calls with cg=1 (per-call graphs,
    kernels/gpu/call_graphs.py) on two alternating input sets, each output cloned and freed
    before the next call (its block comes back, so the call recurs at fixed addresses).
    Returns ([(name, error, reference error)], call_graphs.stats()); the reference is NCCL +
    _scaled_mm on the same inputs."""
    import os

    from torch_commopt.kernels.gpu import call_graphs, symm

    debug_env = os.environ.pop(symm.DEBUG_ENV, None)  # bounded waits never replay (device_run.sh sets them)
    results, pending, seed = [], [], 60000
    for op, sched in REPLAY_CASES:
        draws = []  # drawn first: nothing but the calls allocates between them
        for _ in range(calls):
            seed += 7
            *fresh, truth = _replay_inputs(op, seed, rank, world)
            draws.append((fresh, truth, _rel(_call(op, *fresh, "sequential"), truth)))
        static = [t.clone() for t in draws[0][0]]
        _call(op, *static, sched)  # eager first: buffers and kernels exist before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _call(op, *static, sched)
        for i, (fresh, truth, ref) in enumerate(draws):
            for dst, src in zip(static, fresh):
                dst.copy_(src)
            graph.replay()
            results.append((f"float8 graph {op} {sched} replay {i}", _rel(out, truth), ref))
        cg = str(Schedule.parse(sched).with_params(cg=1))
        sets = [[t.clone() for t in draws[0][0]] for _ in range(2)]
        torch.cuda.synchronize()
        for i, (fresh, truth, ref) in enumerate(draws):
            for dst, src in zip(sets[i % 2], fresh):
                dst.copy_(src)
            out = _call(op, *sets[i % 2], cg)
            got = out.clone()
            del out
            pending.append((f"float8 cg {op} {sched} call {i}", got, truth, ref))
    torch.cuda.synchronize()
    results += [(name, _rel(got, truth), ref) for name, got, truth, ref in pending]
    stats = call_graphs.stats()
    call_graphs.reset()
    if debug_env is not None:
        os.environ[symm.DEBUG_ENV] = debug_env
    return results, stats
