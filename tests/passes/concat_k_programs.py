"""Per-rank programs for the concat-K tests (gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

import torch_commopt

B, S, N = 2, 8, 12
KS = (4, 6, 10)  # the three terms' K


def _reduce(t, how):
    if how == "rs":  # scatter dim 1: the split/cat form SP's reduce-scatter has
        return funcol.reduce_scatter_tensor(t, "sum", 1, dist.group.WORLD)
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def _sum3(a1, w1, a2, w2, a3, w3):
    return (a1 @ w1).view(B, S, N) + (a2 @ w2).view(B, S, N) + (a3 @ w3).view(B, S, N)


def _three_rs(a1, w1, a2, w2, a3, w3):
    return _reduce(_sum3(a1, w1, a2, w2, a3, w3), "rs")


def _three_ar(a1, w1, a2, w2, a3, w3):
    return _reduce(_sum3(a1, w1, a2, w2, a3, w3), "ar")


def _alpha(a1, w1, a2, w2, a3, w3):
    return _reduce(torch.add((a1 @ w1).view(B, S, N), (a2 @ w2).view(B, S, N), alpha=2.0), "rs")


def _shared(a1, w1, a2, w2, a3, w3):
    p = a1 @ w1  # a partial product used twice: not foldable
    return _reduce(p.view(B, S, N) + (a2 @ w2).view(B, S, N), "rs"), p


def _bias(a1, w1, a2, w2, a3, w3):
    return _reduce((a1 @ w1).view(B, S, N) + w3[0, :N], "rs")


def _no_collective(a1, w1, a2, w2, a3, w3):
    return (a1 @ w1).view(B, S, N) + (a2 @ w2).view(B, S, N)


PROGRAMS = {"three_rs": (_three_rs, 3), "three_ar": (_three_ar, 3), "alpha": (_alpha, 0),
            "shared": (_shared, 0), "bias": (_bias, 0), "no_collective": (_no_collective, 0)}


def _run(gm, ins, want) -> float:
    gm.graph.lint()
    gm.recompile()
    got = gm(*ins)
    flat = lambda o: o if isinstance(o, (tuple, list)) else (o,)  # noqa: E731
    return max(float((torch.as_tensor(g) - torch.as_tensor(w)).abs().max()) for g, w in zip(flat(got), flat(want)))


def _ops(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def graph_cases(rank: int, world: int):
    """Per program: (terms folded per note, matmuls left, max abs error vs eager, and after
    undo_unclaimed: notes, (matmuls, cats) beyond the traced program's, max abs error vs eager)."""
    from torch_commopt.passes.matmul.concat_k import concat_k, undo_unclaimed

    torch.manual_seed(1 + rank)
    ins = []
    for k in KS:
        ins += [torch.randn(B * S, k, dtype=torch.float64), torch.randn(k, N, dtype=torch.float64)]
    out = {}
    for name, (fn, _) in PROGRAMS.items():
        want = fn(*ins)
        gm = make_fx(fn, tracing_mode="fake")(*ins)
        traced = (_ops(gm, torch.ops.aten.mm.default), _ops(gm, torch.ops.aten.cat.default))
        notes = concat_k(gm.graph)
        err = _run(gm, ins, want)
        folded = [int(n.split("sum of ")[1].split()[0]) for n in notes]
        mms = _ops(gm, torch.ops.aten.mm.default)
        undone = undo_unclaimed(gm.graph)  # nothing consumed the fused matmuls here
        left = (_ops(gm, torch.ops.aten.mm.default) - traced[0], _ops(gm, torch.ops.aten.cat.default) - traced[1])
        out[name] = (folded, mms, err, len(undone), left, _run(gm, ins, want))
    return out


CHUNKED = {"schedule": "chunked", "chunks": 2}
KEPT = {"mode": "model", "memory_budget_mib": 0}  # the least-memory plan: every region kept as compiled


def block_regions(rank: int, world: int, concat_k: bool, options: dict = CHUNKED, shape: dict | None = None):
    """A TP+SP Llama block (GQA) compiled with commopt: backward regions, concat-K notes, the
    backward graphs' aten.cat count, and each output's and gradient's error vs eager
    (validate.check).  shape: the block's (default: batch 2, seq 8 W, dim 32, hidden 64, 2 W heads)."""
    from torch_commopt.testing.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    errors = check("tp_sp_block", {**options, "concat_k": concat_k, "debug": True},
                   shape=shape or {"batch": 2, "seq": 8 * world, "dim": 32, "hidden": 64, "heads": 2 * world})
    graphs = torch_commopt.explain().graphs
    backward = [r.kind for g in graphs if g.graph_kind == "backward" for r in g.rewritten]
    notes = [n for g in graphs for n in g.notes if "concat-K" in n]
    cats = sum(g.code.count("aten.cat.default") for g in graphs if g.graph_kind == "backward")
    return backward, notes, cats, [(e.name, e.compiled, e.eager) for e in errors]


def block_regions_each(rank: int, world: int, configs: list) -> list:
    """block_regions for each (concat_k, options[, shape]) of `configs` in one process: one start
    of the ranks (and of their imports) for a test's several compiles."""
    return [block_regions(rank, world, *config) for config in configs]


def _readers(a1, w1, a2, w2, a3, w3):
    """The backward's form: pointwise operands that weight-gradient GEMMs also read, one of
    them (d2) defined after d1's reader, plus an operand read by a reshape (which cannot take a
    strided slice) and one that is a graph input (copied whatever happens)."""
    d1 = a1 * 2.0
    g1 = d1.t() @ a3[:, :N]
    d2 = torch.sin(a2)
    g2 = d2.t() @ a3[:, :N]
    d3 = torch.cos(a3)
    flat = d3.reshape(-1)
    dx = _reduce((d1 @ w1).view(B, S, N) + (d2 @ w2).view(B, S, N) + (d3 @ w3).view(B, S, N) + (a1 @ w1).view(B, S, N),
                 "rs")
    return dx, g1, g2, flat


def shared_readers(rank: int, world: int):
    """(max abs error vs eager after the rewrite, slices made, charged bytes and what the
    weights + copied operands weigh, readers of the slices, error and slices left after
    undo_unclaimed, the sum's kept bytes)."""
    from torch_commopt.passes.matmul.concat_k import META, concat_k, copy_bytes, kept_bytes, undo_unclaimed

    torch.manual_seed(3 + rank)
    ins = []
    for k in KS:
        ins += [torch.randn(B * S, k, dtype=torch.float64), torch.randn(k, N, dtype=torch.float64)]
    want = _readers(*ins)
    gm = make_fx(_readers, tracing_mode="fake")(*ins)
    notes = concat_k(gm.graph)
    assert len(notes) == 1, notes
    err = _run(gm, ins, want)
    mm = next(n for n in gm.graph.nodes if "commopt_concat_k" in n.meta)
    slices = mm.meta[META].slices
    # expected charge: the 4 weights (w1 twice) and d3 (its reshape keeps it) and a1 (an input);
    # as K parts (Config.k_parts), what `fused` copies to multiply them concatenated: the 4
    # weights and all 4 operands
    elt = 8
    weights = (2 * KS[0] + KS[1] + KS[2]) * N * elt
    expect = weights + (KS[2] + KS[0]) * B * S * elt
    expect_parts = weights + (2 * KS[0] + KS[1] + KS[2]) * B * S * elt
    readers = sorted(u.target.__name__ for sl in slices for u in sl.users if u is not mm.args[0])
    charged, kept = (copy_bytes(mm), copy_bytes(mm, True)), kept_bytes(mm)
    expect = (expect, expect_parts)
    undo_unclaimed(gm.graph)
    left = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor
               and n.args[0].target is torch.ops.aten.cat.default)
    return err, len(slices), (charged, expect), readers, (_run(gm, ins, want), left), (kept, 3 * 1.5 * B * S * N * elt)
