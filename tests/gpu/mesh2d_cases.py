"""Per-rank programs for the 2D GEMM regions on GPUs (issue 71): a DTensor program on a 2 x 2 mesh
-- X @ W (MeshSlice's os) or F.linear(X, W) (rs) with both operands [Shard(0), Shard(1)] -- compiled
with backend="commopt", forward and backward in bf16, against the whole product and its gradients
in float64; beside it the same program run eagerly by DTensor, whose error is the reference's own."""

from __future__ import annotations

import math

import torch
from kernel_cases import _global, _rel

import torch_commopt
from torch_commopt.kernels.gpu import shared_device


def run_gemm_2d(rank: int, world: int, linear: bool, slices: tuple) -> list:
    """Per entry of `slices` (Config.mesh2d_slices; None: the model's S): (S, the compiled step's
    [loss, dX, dW] errors, eager DTensor's, the regions rewritten as (kind, schedule))."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("rows", "cols"))
    k = 512
    x_full = _global(1, (256, k), torch.float32)  # fresh random, the same on every rank
    w_full = _global(2, (384, k) if linear else (k, 384), torch.float32) / math.sqrt(k)

    def loss_of(x, w):
        y = F.linear(x, w) if linear else x @ w
        return (y.float() ** 2).sum()

    x64, w64 = (t.double().requires_grad_() for t in (x_full, w_full))
    whole = loss_of(x64, w64)
    whole.backward()
    want = [whole.detach(), x64.grad, w64.grad]

    def step(fn) -> list[float]:
        x, w = (distribute_tensor(t.to(torch.bfloat16), mesh, [Shard(0), Shard(1)]).requires_grad_()
                for t in (x_full, w_full))
        loss = fn(x, w)
        loss.backward()
        return [_rel(t.full_tensor(), ref) for t, ref in zip((loss, x.grad, w.grad), want, strict=True)]

    eager = step(loss_of)
    out = []
    for s in slices:
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        got = step(torch.compile(loss_of, backend="commopt", options={"mesh2d_slices": s}))
        regions = [(r.kind, r.schedule) for g in torch_commopt.explain().graphs for r in g.regions
                   if r.status == "rewritten"]
        out.append((s, got, eager, regions))
    return out


def run_ops_2d(rank: int, world: int, slices: tuple, axes: tuple = ("",)) -> list:
    """commopt's 2D GEMM op itself (no DTensor) on bf16 CUDA blocks of a 2 x 2 mesh, every dataflow
    in each slice count, ls and rs also with each per-axis schedule of `axes` ("": c10d's
    reduce-scatter): [(kind, S, the op's relative error, one GPU's bf16 product's)] against the
    float64 product's block, both within this rank's block."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("rows", "cols"))
    if shared_device.enabled():  # the mesh put rank r on GPU r % count: all ranks share GPU 0 here
        torch.cuda.set_device(0)
    i, j = divmod(rank, 2)
    rows, cols = mesh.get_group(0).group_name, mesh.get_group(1).group_name

    def block(t: torch.Tensor) -> torch.Tensor:
        h, w = t.shape[0] // 2, t.shape[1] // 2
        return t[i * h:(i + 1) * h, j * w:(j + 1) * w].contiguous()

    m, k, n = 256, 512, 384  # three sizes: a mixed-up dimension does not fit
    x, w = _global(11, (m, k), torch.float32), _global(12, (k, n), torch.float32) / math.sqrt(k)
    stored = {"os": (x, w, lambda a, b: a @ b), "ls": (x, w.T.contiguous(), lambda a, b: a @ b.T),
              "rs": (x.T.contiguous(), w, lambda a, b: a.T @ b)}
    out = []
    for kind, (a, b, product) in stored.items():
        want = block(product(a.double(), b.double()))
        one_gpu = block(product(a.to(torch.bfloat16), b.to(torch.bfloat16)))
        for s in slices:
            for axis in axes if kind != "os" else ("",):
                got = torch.ops.commopt.gemm_2d(block(a).to(torch.bfloat16), block(b).to(torch.bfloat16), kind, s,
                                                2, 2, rows, cols, False, axis)[0]
                out.append((f"{kind} {axis}".strip(), s, _rel(got, want), _rel(one_gpu, want)))
    return out
