"""Float8 (torch._scaled_mm) TP programs run on live gloo groups by tests/passes/test_float8.py
(importable by spawned workers).  gloo has no float8 type: a float8 shard is gathered as
uint8 and viewed back, as PyTorch's own float8 async-TP tests do."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt
from torch_commopt.testing.validate import rel_err

FP8 = torch.float8_e4m3fn


def _g():
    return dist.group.WORLD.group_name


def gather_fp8(x):
    return funcol.all_gather_tensor(x.view(torch.uint8), gather_dim=0, group=_g()).view(FP8)


def _q(x, shared_amax: bool = False):
    """A float8 tensor and its tensor-wise scale (amax scaling, as torchao's float8 does;
    shared_amax: the amax of every rank's x, so that the gathered tensor has one scale)."""
    amax = x.abs().max()
    if shared_amax:
        every = amax.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(every, op=dist.ReduceOp.MAX)
        amax = every.cpu()
    scale = (amax / torch.finfo(FP8).max).float()
    return (x / scale).to(FP8), scale


def _dq(q, scale):
    return q.double() * scale.double()


def programs():
    """name -> (fn, make_inputs(rank, world, gen_local, gen_shared), fp64 reference(inputs, world))."""
    mm = torch._scaled_mm

    def ag_qk(x, sx, wq, sq, wk, sk):
        g = gather_fp8(x)
        return (mm(g, wq, sx, sq, out_dtype=torch.float32), mm(g, wk, sx, sk, out_dtype=torch.float32))

    def ag_bias(x, sx, w, sw, b):
        return (mm(gather_fp8(x), w, sx, sw, bias=b, out_dtype=torch.bfloat16),)

    def rs(x, sx, w, sw):
        return (funcol.reduce_scatter_tensor(mm(x, w, sx, sw, out_dtype=torch.float32), "sum", 0, group=_g()),)

    def ar(x, sx, w, sw):
        return (funcol.all_reduce(mm(x, w, sx, sw, out_dtype=torch.float32), "sum", group=_g()),)

    def weight(gen, n, k):
        w, s = _q(torch.randn(n, k, generator=gen))
        return w.t(), s  # column-major, as _scaled_mm takes B

    def ag_inputs(rank, world, local, shared, n_w, bias=False):
        x, sx = _q(torch.randn(8, 32, generator=local) * (rank + 1), shared_amax=True)
        out = [x, sx]
        for n in (32, 16)[:n_w]:  # on CUDA _scaled_mm needs K and N multiples of 16
            out += weight(shared, n, 32)
        return out + ([torch.randn(32, generator=shared).to(torch.bfloat16)] if bias else [])

    def red_inputs(rank, world, local, shared):
        x, sx = _q(torch.randn(4 * world, 32, generator=local) * (rank + 1))
        return [x, sx, *weight(shared, 16, 32)]

    def every(t):  # every rank's copy of a local tensor, stacked rank-major
        out = [torch.empty_like(t.view(torch.uint8)) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t.contiguous().view(torch.uint8))
        return [o.view(t.dtype) for o in out]

    def ag_ref(inp, world):
        x, sx, *ws = inp
        xs = torch.cat([_dq(xr, sr) for xr, sr in zip(every(x), every(sx.reshape(1)))])
        bias = ws[2].double() if len(ws) == 3 else 0.0
        return [xs @ _dq(ws[i], ws[i + 1]) + bias for i in range(0, len(ws) - (len(ws) == 3), 2)]

    def red_ref(inp, world, scatter):
        x, sx, w, sw = inp
        parts = [_dq(xr, sr) @ _dq(w, sw) for xr, sr in zip(every(x), every(sx.reshape(1)))]
        total = sum(parts)
        return [total.chunk(world)[dist.get_rank()] if scatter else total]

    return {
        "ag_qk": (ag_qk, lambda r, w, rows, s: ag_inputs(r, w, rows, s, 2), ag_ref),
        "ag_bias": (ag_bias, lambda r, w, rows, s: ag_inputs(r, w, rows, s, 1, bias=True), ag_ref),
        "rs": (rs, red_inputs, lambda inp, w: red_ref(inp, w, True)),
        "ar": (ar, red_inputs, lambda inp, w: red_ref(inp, w, False)),
    }


def run_float8_programs(rank: int, world: int, options: dict):
    """[(name, [(compiled error, eager error)], rewritten region summaries, output dtypes)] of
    every program (on CUDA under NCCL)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    results = []
    for name, (fn, make, ref) in programs().items():
        local = torch.Generator().manual_seed(100 + rank)
        shared = torch.Generator().manual_seed(7)
        inputs = [t.to(device) for t in make(rank, world, local, shared)]  # .to keeps B column-major
        expected = ref(inputs, world)
        eager = fn(*inputs)
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        compiled = torch.compile(fn, backend="commopt", options=options)(*inputs)
        regions = [r.summary for g in torch_commopt.explain().graphs for r in g.rewritten]
        errors = [(rel_err(c, e_ref), rel_err(e, e_ref)) for c, e, e_ref in zip(compiled, eager, expected)]
        dtypes = [str(c.dtype) for c in compiled]
        results.append((name, errors, regions, dtypes))
    return results
