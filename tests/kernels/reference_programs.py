"""Direct calls of torch.ops.commopt.* on live gloo groups, against plain torch on full tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_commopt  # noqa: F401  (registers the ops)
from torch_commopt.testing.validate import rel_err

SCHEDULES = ("sequential", "chunked:2", "chunked:3", "chunked:64")
AG_ONLY = ("local_first",)
AR_ONLY = ("gather_sum", "scatter_gather", "oneshot", "twoshot")  # off the GPU: their twins


def _rand(gen, *shape):
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)


def ag_cases(world):
    """(local shape, gather dim, weight shapes, with bias)"""
    return [
        ((10, 16), 0, [(16, 8)], False),
        ((2, 5, 16), 1, [(16, 8), (16, 4)], True),
        ((3, 4, 16), 0, [(16, 8)], False),
        ((2, 5, 8), 2, [(8 * world, 8)], False),
        ((6, 8), 1, [(8 * world, 5), (8 * world, 3)], True),  # the contracted dim gathered: a sum over ranks
        ((3, 4, 16), 0, [(3 * world, 16, 8)], False),  # bmm, batch gathered
        ((3, 4, 16), 1, [(3, 16, 8)], False),  # bmm, rows gathered
    ]


def rs_cases(world):
    """(A shape, scatter dim, N, with bias)"""
    return [((4 * world, 16), 0, 8, False), ((2, 3 * world, 16), 1, 8, True),
            ((2, 5, 16), 2, 4 * world, False), ((world, 7, 16), 0, 8, False)]


def _check(name, fn, ref32, ref64, results):
    out = fn()
    outs = out if isinstance(out, (list, tuple)) else [out]
    refs32 = ref32 if isinstance(ref32, (list, tuple)) else [ref32]
    refs64 = ref64 if isinstance(ref64, (list, tuple)) else [ref64]
    for i, (o, r32, r64) in enumerate(zip(outs, refs32, refs64)):
        assert o.shape == r64.shape, f"{name}[{i}]: shape {tuple(o.shape)} != {tuple(r64.shape)}"
        results.append((f"{name}[{i}]", rel_err(o, r64), rel_err(r32, r64)))


def _fake_shapes(op, *args):
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a] if isinstance(a, list) else a
                for a in args]
        out = op(*fake)
    return [tuple(t.shape) for t in (out if isinstance(out, list) else [out])]


def run_reference_cases(rank: int, world: int, seed: int = 0):
    group = dist.group.WORLD.group_name
    results, fake_mismatch = [], []
    for i, (shape, g, wshapes, with_bias) in enumerate(ag_cases(world)):
        gen = torch.Generator().manual_seed(seed + i)
        shards = [_rand(gen, *shape) for _ in range(world)]
        weights = [_rand(gen, *s) for s in wshapes]
        biases = [_rand(gen, s[-1]) if with_bias else None for s in wshapes]
        for keep in (False, True):
            for sched in SCHEDULES + AG_ONLY:
                def expected(dtype):
                    full = torch.cat([s.to(dtype) for s in shards], dim=g)
                    outs = [torch.matmul(full, w.to(dtype)) + (0 if b is None else b.to(dtype)) for w, b in zip(weights, biases)]
                    return outs + ([full] if keep else [])

                args = (shards[rank].float(), [w.float() for w in weights],
                        [None if b is None else b.float() for b in biases], g, world, group, sched, keep)
                op = torch.ops.commopt.ag_matmul.default
                _check(f"ag{i} {sched} keep={keep}", lambda: op(*args), expected(torch.float32), expected(torch.float64), results)
                real = [tuple(t.shape) for t in op(*args)]
                if _fake_shapes(op, *args) != real:
                    fake_mismatch.append(f"ag{i}")
    for i, (shape, d, n, with_bias) in enumerate(rs_cases(world)):
        gen = torch.Generator().manual_seed(seed + 100 + i)
        a_all = [_rand(gen, *shape) for _ in range(world)]
        weights = [_rand(gen, shape[-1], n) for _ in range(world)]
        bias = _rand(gen, n) if with_bias else None
        for reduce_op in ("sum", "avg"):
            for sched in SCHEDULES + AR_ONLY:
                ar_only = sched in AR_ONLY
                def t_sum(dtype):
                    total = sum(torch.matmul(a.to(dtype), w.to(dtype)) + (0 if bias is None else bias.to(dtype))
                                for a, w in zip(a_all, weights))
                    return total / world if reduce_op == "avg" else total

                def expected_rs(dtype):
                    return t_sum(dtype).chunk(world, dim=d)[rank]

                b = None if bias is None else bias.float()
                rs_args = (a_all[rank].float(), weights[rank].float(), b, d, reduce_op, world, group, sched)
                ar_args = (a_all[rank].float(), weights[rank].float(), b, reduce_op, world, group, sched)
                rs, ar = torch.ops.commopt.matmul_rs.default, torch.ops.commopt.matmul_ar.default
                if not ar_only:
                    _check(f"rs{i} {reduce_op} {sched}", lambda: rs(*rs_args), expected_rs(torch.float32),
                           expected_rs(torch.float64), results)
                _check(f"ar{i} {reduce_op} {sched}", lambda: ar(*ar_args), t_sum(torch.float32), t_sum(torch.float64), results)
                if not ar_only and _fake_shapes(rs, *rs_args) != [tuple(rs(*rs_args).shape)]:
                    fake_mismatch.append(f"rs{i}")
                if ar_only and _fake_shapes(ar, *ar_args) != [tuple(ar(*ar_args).shape)]:
                    fake_mismatch.append(f"ar{i} {sched}")
                # the same product as K parts (concat-K's terms): K = 6 + 3 + 7, the first part
                # contiguous, the others strided views of A
                a32, w32 = a_all[rank].float(), weights[rank].float()
                cuts = [(0, 6), (6, 9), (9, 16)]
                first, *more = [(a32[..., lo:hi], w32[lo:hi]) for lo, hi in cuts]
                parts = {"more_a": [x for x, _ in more], "more_w": [w for _, w in more]}
                rs_parts = (first[0].contiguous(), first[1], *rs_args[2:])
                ar_parts = (first[0].contiguous(), first[1], *ar_args[2:])
                if not ar_only:
                    _check(f"rs{i} {reduce_op} {sched} K parts", lambda: rs(*rs_parts, **parts),
                           expected_rs(torch.float32), expected_rs(torch.float64), results)
                _check(f"ar{i} {reduce_op} {sched} K parts", lambda: ar(*ar_parts, **parts), t_sum(torch.float32),
                       t_sum(torch.float64), results)
    return results, fake_mismatch


def run_rank_order_sums(rank: int, world: int) -> list:
    """gather_sum and scatter_gather in bf16 at decode-sized rows (M = 1, 3, 8; N not a multiple of
    W; bias; sum and avg): [(case, bits of the result)] for the test to compare across ranks and
    schedules, and [(case, error vs float64, plain all-reduce's error)]."""
    group = dist.group.WORLD.group_name
    bits, errors = [], []
    for m in (1, 3, 8):
        for n in (7, 64 * world + 5):
            gen = torch.Generator().manual_seed(m * 1000 + n)
            a_all = [torch.randn(m, 32, generator=gen, dtype=torch.float64) for _ in range(world)]
            w_all = [torch.randn(32, n, generator=gen, dtype=torch.float64) for _ in range(world)]
            bias = torch.randn(n, generator=gen, dtype=torch.float64)
            for reduce_op in ("sum", "avg"):
                total = sum(a @ w + bias for a, w in zip(a_all, w_all))
                want = total / world if reduce_op == "avg" else total
                args = (a_all[rank].bfloat16(), w_all[rank].bfloat16(), bias.bfloat16(), reduce_op, world, group)
                plain = torch.ops.commopt.matmul_ar(*args, "sequential")
                for sched in AR_ONLY:
                    out = torch.ops.commopt.matmul_ar(*args, sched)
                    case = f"m{m} n{n} {reduce_op}"
                    bits.append((f"{case} {sched}", out.view(torch.int16).tolist()))
                    errors.append((f"{case} {sched}", rel_err(out, want), rel_err(plain, want)))
    return bits, errors
