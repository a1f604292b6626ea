"""Per-rank program for the fixed-capacity MoE rewrite (passes/moe): testing.models.CapacityMoE
compiled by commopt against the same layer run eagerly, forward and backward (gloo, float64)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_commopt
from torch_commopt.testing.models import CapacityMoE


def capacity_moe_fwd_bwd(rank: int, world: int, schedule: str, experts: int = 8, capacity: int = 6):
    """(explain notes, (kind, collectives before, after) per graph, output error, gradient errors):
    the layer compiled with Config.moe_schedule `schedule` against eager, with fresh random
    inputs on every rank (the routing differs by rank; some experts overflow their capacity)."""
    torch.manual_seed(0)  # the same router on every rank; experts differ by rank below
    layer = CapacityMoE(16, 24, experts, world, capacity, dist.group.WORLD.group_name).double()
    with torch.no_grad():
        for w in (layer.w1, layer.w2, layer.w3):
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(10 + rank), dtype=w.dtype) * 0.3)
    x = torch.randn(20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
    dy = torch.randn(20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(200 + rank))
    want = layer(x)
    want.backward(dy)
    ref = [t.grad.clone() for t in (x, layer.w1, layer.w2, layer.w3, layer.router.weight)]
    for t in (x, layer.w1, layer.w2, layer.w3, layer.router.weight):
        t.grad = None
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    got = torch.compile(layer, backend="commopt", options={"moe_schedule": schedule})(x)
    got.backward(dy)
    grads = [t.grad for t in (x, layer.w1, layer.w2, layer.w3, layer.router.weight)]
    graphs = torch_commopt.explain().graphs
    counts = [(g.graph_kind, g.collectives_before.get("all_to_all", 0), g.collectives_after.get("all_to_all", 0))
              for g in graphs]
    return ([n for g in graphs for n in g.notes], counts, float((got - want).detach().norm() / want.detach().norm()),
            [float((a - b).norm() / b.norm()) for a, b in zip(grads, ref)])


def _mixing(x, w, mix, group_name: str, world: int):
    """An exchange pair whose middle mixes the experts (a sum over them): not chunkable."""
    import torch.distributed._functional_collectives as funcol

    got = funcol.all_to_all_single_autograd(x, None, None, group_name)
    h = got.view(world, 2, -1, x.shape[-1]).transpose(0, 1).reshape(2, -1, x.shape[-1])
    h = torch.bmm(h, w)
    h = torch.einsum("erd,ef->frd", h, mix)  # every output expert reads every input expert
    y = h.reshape(2, world, -1, x.shape[-1]).transpose(0, 1).reshape(x.shape)
    return funcol.all_to_all_single_autograd(y, None, None, group_name)


def mixing_left_alone(rank: int, world: int):
    """(the moe skip reasons, the output's error against eager) for _mixing compiled by commopt."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(world * 2 * 3, 8, dtype=torch.float64, generator=g)
    w = torch.randn(2, 8, 8, dtype=torch.float64, generator=g)
    mix = torch.randn(2, 2, dtype=torch.float64, generator=g)
    group = dist.group.WORLD.group_name
    want = _mixing(x, w, mix, group, world)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    got = torch.compile(_mixing, backend="commopt", options={"moe_schedule": "by_expert:2"})(x, w, mix, group, world)
    reasons = [s.reason for gr in torch_commopt.explain().graphs for s in gr.skipped if s.kind == "moe"]
    return reasons, float((got - want).norm() / want.norm())
