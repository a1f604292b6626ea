"""Concat-K: a sum of matmuls that feeds a reduction collective becomes one matmul.

    add(view(mm(a1, w1)), view(mm(a2, w2)), ...) -> row-preserving chain -> reduce_scatter / all_reduce
becomes
    view(mm(cat([a1, a2, ...], dim=1), cat([w1, w2, ...], dim=0))) -> ... -> the same collective

which the matmul -> reduce finder then turns into one overlapped region.  The backward of a
column-parallel layer group has this form: dX = dq Wq + dk Wk + dv Wv (attention) and
dX = d1 W1 + d3 W3 (SwiGLU), each summed and then reduce-scattered (SP) or all-reduced (TP).
Exact up to rounding, and closer to the fp32 sum than the original: the products are added in
the GEMM's fp32 accumulator instead of being rounded to the dtype one by one and added.  The
price is two copies, the A operands side by side (M x sum K) and the weights stacked
(sum K x N), each written once per call.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.chains import keeps_last_dim, set_fake_val
from torch_commopt.passes.find_matmul_reduce import scatter_form
from torch_commopt.passes.graph_utils import ALL_REDUCE, MM, REDUCE_SCATTER, RESHAPES, aten, only_user, static_shape, val

ADD = aten.add.Tensor


def concat_k(graph: Graph) -> list[str]:
    """Apply the rewrite wherever it holds; one note per rewritten sum."""
    notes = []
    for coll in [n for n in graph.nodes if n.op == "call_function" and n.target in (REDUCE_SCATTER, ALL_REDUCE)]:
        top = _sum_feeding(coll)
        terms = _terms(top) if top is not None else None
        if terms is None or len(terms) < 2:
            continue
        k = " + ".join(str(static_shape(mm.args[0])[-1]) for _, mm in terms)
        _rewrite(graph, top, terms)
        notes.append(f"{coll.name}: sum of {len(terms)} matmuls (K = {k}) -> one matmul over the concatenated K "
                     "(concat-K)")
    return notes


def _sum_feeding(coll: Node) -> Node | None:
    """The add at the head of the collective's single-user row-preserving input chain, if any."""
    t = coll.args[0]
    if coll.target is REDUCE_SCATTER and (form := scatter_form(t, coll.args[2])) is not None:
        t = form[0]
    while True:
        if len(t.users) != 1 or t.op != "call_function":
            return None
        if t.target is ADD:
            return t if _is_plain_add(t) else None
        if not keeps_last_dim(t):
            return None
        t = t.args[0]


def _is_plain_add(node: Node) -> bool:
    """add(x, y) of two nodes of one shape (no alpha, no broadcast, no scalar)."""
    if node.kwargs or len(node.args) != 2 or not all(isinstance(a, Node) for a in node.args):
        return False
    shapes = [val(a) for a in (node, *node.args)]
    return all(s is not None for s in shapes) and len({tuple(s.shape) for s in shapes}) == 1


def _terms(add: Node) -> list[tuple[Node | None, Node]] | None:
    """The (view or None, mm) leaves of a single-user add tree, or None where a leaf is not
    a single-user matmul (through at most one reshape to the add's shape)."""
    out_shape, terms = static_shape(add), []
    for x in add.args:
        if len(x.users) != 1 or x.op != "call_function":
            return None
        if x.target is ADD:
            if not _is_plain_add(x) or (sub := _terms(x)) is None:
                return None
            terms += sub
            continue
        view, mm = (x, x.args[0]) if x.target in RESHAPES else (None, x)
        if not isinstance(mm, Node) or mm.op != "call_function" or mm.target is not MM or len(mm.users) != 1:
            return None
        if view is None and static_shape(mm) != out_shape:
            return None
        terms.append((view, mm))
    first = val(terms[0][1])
    for view, mm in terms:
        a, w, out = val(mm.args[0]), val(mm.args[1]), val(mm)
        if a is None or w is None or out.dtype != first.dtype or a.dtype != w.dtype or out.shape != first.shape:
            return None
        if (view is None) != (terms[0][0] is None):
            return None
    return terms


def _rewrite(graph: Graph, add: Node, terms: list[tuple[Node | None, Node]]) -> None:
    """One mm over the concatenated operands, viewed like the first term, replaces the add tree."""
    with graph.inserting_before(add):
        a = graph.call_function(aten.cat.default, ([mm.args[0] for _, mm in terms], 1))
        set_fake_val(a)
        w = graph.call_function(aten.cat.default, ([mm.args[1] for _, mm in terms], 0))
        set_fake_val(w)
        mm = graph.call_function(MM, (a, w))
        set_fake_val(mm)
        out = mm
        view = terms[0][0]
        if view is not None:
            out = graph.call_function(view.target, (mm, *view.args[1:]), dict(view.kwargs))
            set_fake_val(out)
    if tuple(val(out).shape) != tuple(val(add).shape) or val(out).dtype != val(add).dtype:
        raise AssertionError(f"concat-K: {out.name} {tuple(val(out).shape)} does not match {add.name}")
    add.replace_all_uses_with(out)
    _erase_tree(graph, add)


def _erase_tree(graph: Graph, node: Node) -> None:
    """Erase an add tree and its view / mm leaves (each now without users), root first."""
    inputs = [a for a in node.args if isinstance(a, Node)]
    graph.erase_node(node)
    for x in inputs:
        if not x.users and x.target in (ADD, MM, *RESHAPES):
            _erase_tree(graph, x)
