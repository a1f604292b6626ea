"""Per-rank program for the B-side gather test (gloo, 2 ranks): a weight's column shards
all-gathered (funcol: split / cat along dim 1) into a matmul's second operand."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt


def _program(x, w_cols):
    w = funcol.all_gather_tensor(w_cols, gather_dim=1, group=dist.group.WORLD)  # [K, N]: N gathered
    return torch.relu(x @ w).sum()


def b_gather_fwd_bwd(rank: int, world: int):
    """(explain notes, the regions rewritten, the loss's error, the weight gradient's error) of the
    program compiled by commopt against eager, float64.  x needs no gradient, so the gathered weight
    feeds the matmul alone (nothing saves it for a dX): the form the turn takes."""
    torch.manual_seed(rank)
    x = torch.randn(12, 16, dtype=torch.float64)
    w_cols = torch.randn(16, 10, dtype=torch.float64, requires_grad=True)
    want = _program(x, w_cols)
    want.backward()
    grads = [w_cols.grad.clone()]
    w_cols.grad = None
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    got = torch.compile(_program, backend="commopt")(x, w_cols)
    got.backward()
    graphs = torch_commopt.explain().graphs
    return ([n for g in graphs for n in g.notes], [(r.kind, r.schedule) for g in graphs for r in g.rewritten],
            abs(got.item() - want.item()) / abs(want.item()),
            [float((t.grad - ref).norm() / ref.norm()) for t, ref in zip((w_cols,), grads)])
