"""Per-rank programs for the CoCoNet reorder test (gloo, 2 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt


def _program(x, y, z, w, b):
    gather = lambda t: funcol.all_gather_tensor(t, gather_dim=0, group=dist.group.WORLD)  # noqa: E731
    h = torch.relu(gather(x))  # a unary op: moves before the gather, which then meets the matmul
    k = torch.relu(gather(y).double()).float()  # widening cast first: gathering it would move more bytes
    m = torch.relu(gather(z) + b)  # a per-rank bias add: moving it would change the result
    return (h @ w).sum(dim=1) + (k @ w).sum(dim=1) + (m @ w).sum(dim=1)


def reorder_fwd_bwd(rank: int, world: int):
    """(explain notes, region kinds of every graph, forward error, grad errors) of the program
    compiled with coconet=True against eager."""
    torch.manual_seed(rank)
    ins = [torch.randn(16, 24, requires_grad=True) for _ in range(3)] + [
        torch.randn(24, 8, requires_grad=True), torch.randn(24, requires_grad=True)]
    want = _program(*ins)
    want.sum().backward()
    grads = [t.grad.clone() for t in ins]
    for t in ins:
        t.grad = None
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    got = torch.compile(_program, backend="commopt", options={"coconet": True, "schedule": "chunked", "chunks": 2})(*ins)
    got.sum().backward()
    rel = lambda a, r: float((a.detach() - r).norm() / r.norm())  # noqa: E731
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes]
    kinds = [r.kind for g in graphs for r in g.rewritten]
    return notes, kinds, rel(got, want.detach()), [rel(t.grad, gr) for t, gr in zip(ins, grads)]


def tp_sp_block_with_coconet(rank: int, world: int, dtype_name: str):
    """A TP+SP Llama block compiled with coconet=True (and concat-K) vs eager: (moved
    all-gather notes, rewritten region kinds, [(name, compiled error, eager error)])."""
    from torch_commopt.testing.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check("tp_sp_block", {"coconet": True, "schedule": "chunked", "chunks": 2},
                   shape={"batch": 2, "seq": 8 * world, "dim": 32, "hidden": 64, "heads": 2 * world},
                   dtype=getattr(torch, dtype_name))
    graphs = torch_commopt.explain().graphs
    moved = [n for g in graphs for n in g.notes if "all-gather moved after" in n]
    kinds = [r.kind for g in graphs for r in g.rewritten]
    return moved, kinds, [(e.name, e.compiled, e.eager) for e in errors]
