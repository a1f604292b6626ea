"""Per-rank program: a TP+SP block compiled with and without Config.regather_for_backward."""

from __future__ import annotations

import torch

import torch_commopt

SHAPE = {"batch": 2, "seq": 16, "dim": 64, "hidden": 128, "heads": 4}


def saved_and_gathers_by_option(rank: int, world: int, kind: str, budgets: tuple) -> dict:
    """{budget_mib: saved_and_gathers(..., budget_mib)} and {"regather": saved_and_gathers(...,
    regather=True)} in one process (one spawn for them all)."""
    runs = {b: saved_and_gathers(rank, world, kind, False, b) for b in budgets}
    runs["regather"] = saved_and_gathers(rank, world, kind, True)
    return runs


def saved_and_gathers(rank: int, world: int, kind: str, regather: bool, budget_mib: float | None = None):
    """(bytes saved for backward, all-gathers in the backward graph, errors vs float64 next to
    eager's, the joint-graph notes) of `kind` compiled with regather_for_backward=regather
    (or saved_gather_budget_mib=budget_mib)."""
    from torch_commopt.testing.validate import build, check

    options = {"schedule": "sequential", "regather_for_backward": regather, "saved_gather_budget_mib": budget_mib}
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check(kind, options, shape=SHAPE)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    model, x = build(kind, torch.float32, 0, SHAPE)
    fn = torch.compile(model, backend="commopt", options=options)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    x = x.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.sum().backward()
    graphs = torch_commopt.explain().graphs
    gathers = sum(g.collectives_before.get("all_gather", 0) for g in graphs if g.graph_kind == "backward")
    notes = [n for g in graphs for n in g.notes if "gather" in n]
    return sum(saved), gathers, [(e.name, e.compiled, e.eager) for e in errors], notes
