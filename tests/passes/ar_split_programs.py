"""Per-rank programs for the all-reduce split (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt


def _all_reduce(t):
    return funcol.all_reduce(t, "sum", group=dist.group.WORLD.group_name)


def _tp_layer(x, a, wo, g, w1):
    """Row-parallel output projection -> all-reduce -> residual -> RMSNorm -> column-parallel
    matmul, twice (the second layer's residual is the first one's output)."""
    h = x + _all_reduce(a @ wo)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    u = torch.relu(n @ w1)
    h2 = h + _all_reduce(u @ w1.t())
    n2 = h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    return h2, n2 @ w1


def split_forward(rank: int, world: int, rows: int = 16, mode=True, replicated_x: bool = True, policy: str = "always"):
    """(notes, region kinds, relative error of each output vs eager) for the program compiled
    with ar_split=mode; x and g are the same on every rank (the split's assumption) unless
    replicated_x=False, the matmul operands differ per rank.  A raised NotReplicated comes
    back as its message."""
    from torch_commopt.kernels.matmul.ops import NotReplicated

    shared = torch.Generator().manual_seed(7)
    x, g = torch.randn(rows, 32, generator=shared), torch.randn(32, generator=shared)
    if not replicated_x:
        x = x + rank
    torch.manual_seed(100 + rank)
    a, wo, w1 = torch.randn(rows, 8), torch.randn(8, 32) / 8**0.5, torch.randn(32, 16) / 32**0.5
    want = _tp_layer(x, a, wo, g, w1)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    options = {"ar_split": mode, "ar_split_policy": policy, "schedule": "chunked", "chunks": 2}
    compiled = torch.compile(_tp_layer, backend="commopt", options=options)
    try:
        got = compiled(x, a, wo, g, w1)
    except NotReplicated as e:
        return str(e)
    graphs = torch_commopt.explain().graphs
    notes = [n for gr in graphs for n in gr.notes]
    kinds = [r.kind for gr in graphs for r in gr.rewritten]
    return notes, kinds, [float((o - w).norm() / w.norm()) for o, w in zip(got, want)]


def split_tp_block(rank: int, world: int, batch: int = 2):
    """A Llama block with tensor parallelism and no sequence parallelism (DTensor), compiled
    with ar_split=True: (errors vs float64 next to eager's, notes, region kinds)."""
    from torch_commopt.testing.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check("tp_block", {"ar_split": True, "ar_split_policy": "always", "schedule": "chunked", "chunks": 2},
                   shape={"batch": batch, "seq": 8, "dim": 32, "hidden": 64, "heads": 2 * world})
    graphs = torch_commopt.explain().graphs
    return ([(e.name, e.compiled, e.eager) for e in errors], [n for g in graphs for n in g.notes],
            [(g.graph_kind, r.kind) for g in graphs for r in g.rewritten])


def joint_split_decisions(rank: int, world: int, keep_ms: float, split_ms: float, gather_ms: float):
    """The split decisions of split_forward's two-layer program with split_cost and the residual
    gather's price fixed (every candidate: keep_ms kept, split_ms split alone, of which
    gather_ms is the residual's gather): (notes, relative errors vs eager)."""
    import torch_commopt.passes.matmul.split_plan as split_plan
    from torch_commopt.reshard.ar_cost import SplitCost

    split_plan.split_cost = lambda shapes, cal: SplitCost(keep_ms, split_ms)
    split_plan.gather_ms = lambda v, world, cal: gather_ms
    notes, _, errors = split_forward(rank, world, 16, True, True, "cost")
    return [n for n in notes if "joint plan" in n or "split into" in n], errors
