"""Concat-K: a sum of matmuls that feeds a reduction collective becomes one matmul.

    add(view(mm(a1, w1)), view(mm(a2, w2)), ...) -> row-preserving chain -> reduce_scatter / all_reduce
becomes
    view(mm(cat([a1, a2, ...], dim=1), cat([w1, w2, ...], dim=0))) -> ... -> the same collective

which the matmul -> reduce finder then turns into one overlapped region.  The backward of a
column-parallel layer group has this form: dX = dq Wq + dk Wk + dv Wv (attention) and
dX = d1 W1 + d3 W3 (SwiGLU), each summed and then reduce-scattered (SP) or all-reduced (TP).
Exact up to rounding, and closer to the fp32 sum than the original: the products are added in
the GEMM's fp32 accumulator instead of being rounded to the dtype one by one and added.

What it costs: the weights stacked (sum K x N), a copy per call, and the A operands side by
side (M x sum K).  The cat of the A operands is placed right after the last of them, and their
other readers (the weight-gradient GEMMs of the backward) read their slices of it instead, so
an operand computed by a pointwise kernel (SwiGLU's backward, or the clone that lays out
attention's dq/dk/dv) is written straight into its slice by Inductor, no copy; any other
operand is copied (`copy_bytes`).  A reader whose output would change layout on the strided
slice (other than a transpose feeding matmuls) keeps the operand, which is then copied.

With K parts (Config.k_parts) the region rewrite (passes/matmul/rewrite.py) hands the op the
terms (kernels/ops.k_parts: each piece's product one GEMM per term, added in place), takes both
cats out again and gives the operands' other readers their operands back (`operand_parts`,
`drop_cats`): the cats only serve to find and price the region as one matmul, and the copies
they would cost (the stacked weights; a pointwise producer such as SwiGLU's backward writing
into the strided cat) are not paid; each term after the first costs a pass over the product
instead.  By default ("auto") a region takes
the parts where they move fewer bytes (`parts_pay`).  Only `fused` multiplies the parts
concatenated, inside the op.

The rewrite is a bet on the region: it pays only where an op of ours takes the fused matmul.
Where the region is kept as compiled (its chosen schedule is `sequential`, or it was not
found or not decided), `undo_unclaimed` restores the original sum of matmuls, so a kept
region does not pay the copies (about 0.15 ms a step for the w1/w3 backward of a
Llama-3-8B layer at TP 2, seq 8192).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.chains import keeps_last_dim, set_fake_val
from torch_commopt.passes.graph_utils import (
    ALL_REDUCE,
    MM,
    REDUCE_SCATTER,
    RESHAPES,
    aten,
    row_shape,
    same_shape,
    same_size,
    size_hint,
    val,
)
from torch_commopt.passes.matmul.find_matmul_reduce import scatter_form

ADD = aten.add.Tensor
SLICE = aten.slice.Tensor
META = "commopt_concat_k"  # on the fused mm: how to restore the sum it replaced (_Undo)
# a reader of an operand that may take its slice of the cat even though its output's strides
# change (a transposed view), provided every reader of that output is a matmul
TRANSPOSES = {aten.permute.default, aten.t.default, aten.transpose.int}
MATMULS = {MM, aten.addmm.default, aten.bmm.default}


def concat_k(graph: Graph) -> list[str]:
    """Apply the rewrite wherever it holds; one note per rewritten sum."""
    notes = []
    for coll in [n for n in graph.nodes if n.op == "call_function" and n.target in (REDUCE_SCATTER, ALL_REDUCE)]:
        top = _sum_feeding(coll)
        terms = _terms(top) if top is not None else None
        if terms is None or len(terms) < 2:
            continue
        k = " + ".join(str(row_shape(mm.args[0])[-1]) for _, mm in terms)
        _rewrite(graph, top, terms, _tree(top, iter(range(len(terms)))))
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
    vals = [val(a) for a in (node, *node.args)]
    return all(v is not None for v in vals) and all(same_shape(v.shape, vals[0].shape) for v in vals[1:])


def _terms(add: Node) -> list[tuple[Node | None, Node]] | None:
    """The (view or None, mm) leaves of a single-user add tree, or None where a leaf is not
    a single-user matmul (through at most one reshape to the add's shape)."""
    out_shape, terms = row_shape(add), []
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
        if view is None and not same_shape(row_shape(mm), out_shape):
            return None
        terms.append((view, mm))
    first = val(terms[0][1])
    for view, mm in terms:
        a, w, out = val(mm.args[0]), val(mm.args[1]), val(mm)
        if a is None or w is None or out.dtype != first.dtype or a.dtype != w.dtype or not same_shape(out.shape, first.shape):
            return None
        if (view is None) != (terms[0][0] is None):
            return None
    return terms


def _tree(add: Node, leaves) -> tuple:
    """The add tree's shape over the leaves' indices in _terms order: ((0, 1), 2) for
    add(add(t0, t1), t2).  The undo rebuilds this order, so it rounds as the program did."""
    return tuple(_tree(x, leaves) if x.target is ADD else next(leaves) for x in add.args)


def _rewrite(graph: Graph, add: Node, terms: list[tuple[Node | None, Node]], tree: tuple) -> None:
    """One mm over the concatenated operands, viewed like the first term, replaces the add tree."""
    operands = [mm.args[0] for _, mm in terms]
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_after(max(operands, key=order.__getitem__)):  # then their readers can take slices
        a = graph.call_function(aten.cat.default, (operands, 1))
    set_fake_val(a)
    with graph.inserting_before(add):
        w = graph.call_function(aten.cat.default, ([mm.args[1] for _, mm in terms], 0))
        set_fake_val(w)
        mm = graph.call_function(MM, (a, w))
        set_fake_val(mm)
        out = mm
        view = terms[0][0]
        if view is not None:
            out = graph.call_function(view.target, (mm, *view.args[1:]), dict(view.kwargs))
            set_fake_val(out)
    if not same_shape(val(out).shape, val(add).shape) or val(out).dtype != val(add).dtype:
        raise AssertionError(f"concat-K: {out.name} {tuple(val(out).shape)} does not match {add.name}")
    add.replace_all_uses_with(out)
    _erase_tree(graph, add)
    slices = _share(graph, a, operands, min(operands, key=order.__getitem__))
    mm.meta[META] = _Undo([None if v is None else (v.target, v.args[1:], dict(v.kwargs)) for v, _ in terms],
                          tree, add.name, slices)


def _share(graph: Graph, cat: Node, operands: list[Node], first: Node) -> dict[Node, Node]:
    """Point the operands' other readers at their slices of the cat, so that Inductor can
    compute each operand straight into the cat (module docstring).  `first`: the earliest
    operand in the graph.  {slice: operand}."""
    slices, start, anchor, targets = {}, 0, cat, set(operands)
    for x in operands:
        k = row_shape(x)[-1]
        readers = [u for u in x.users if u is not cat]
        start, lo = start + k, start
        if not readers or operands.count(x) > 1:
            continue
        with graph.inserting_after(anchor):
            sl = graph.call_function(SLICE, (cat, 1, lo, lo + k))
        set_fake_val(sl)
        window = _between(first, cat)
        moved = [u for u in readers if _redirect(u, x, sl, targets, window)]
        if not moved:
            graph.erase_node(sl)
            continue
        slices[sl] = x
        anchor = _after(sl, set(moved), first, cat)
    return slices


def _between(first: Node, last: Node) -> set[Node]:
    """The nodes from `first` up to (not including) `last`, in graph order."""
    out, n = set(), first
    while n is not last:
        out.add(n)
        n = n.next
    return out


def _redirect(user: Node, x: Node, sl: Node, operands: set[Node], window: set[Node]) -> bool:
    """Let `user` read `sl` instead of `x` where its result keeps its layout (or it is a
    transpose only matmuls read) and no operand depends on it (a cycle through the cat)."""
    if _reaches(user, operands, window):
        return False
    before = user.meta.get("val")
    user.replace_input_with(x, sl)
    try:
        set_fake_val(user)
        after = val(user)
        same = (isinstance(before, torch.Tensor) and after is not None and after.dtype == before.dtype
                and same_shape(after.shape, before.shape) and _same_strides(after, before))
        ok = same or (user.target in TRANSPOSES and all(u.target in MATMULS for u in user.users))
    except Exception:  # noqa: BLE001 - the reader cannot take the strided slice: it keeps x
        ok = False
    if not ok:
        user.replace_input_with(sl, x)
        user.meta["val"] = before
    return ok


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return len(a.stride()) == len(b.stride()) and all(same_size(p, q) for p, q in zip(a.stride(), b.stride()))


def _reaches(start: Node, targets: set[Node], window: set[Node]) -> bool:
    """Whether one of `targets` (all inside `window`) depends on `start`: only nodes inside
    the window can lead to them."""
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n in seen or n not in window:
            continue
        seen.add(n)
        todo.extend(n.users)
    return False


def _after(anchor: Node, readers: set[Node], first: Node, cat: Node) -> Node:
    """Move the readers that precede the cat, and what depends on them before it, to just
    after `anchor`, keeping their order; the last node placed (the next anchor)."""
    moving, n = set(), first
    while n is not cat:
        nxt = n.next
        if n in readers or any(i in moving for i in n.all_input_nodes):
            moving.add(n)
            anchor.append(n)
            anchor = n
        n = nxt
    return anchor


def _erase_tree(graph: Graph, node: Node) -> None:
    """Erase an add tree and its view / mm leaves (each now without users), root first."""
    inputs = [a for a in node.args if isinstance(a, Node)]
    graph.erase_node(node)
    for x in inputs:
        if not x.users and x.target in (ADD, MM, *RESHAPES):
            _erase_tree(graph, x)


@dataclass(frozen=True)
class _Undo:
    """What the fused mm replaced: each term's view (target, args after the input, kwargs)
    or None, the add tree over the terms, the root add's name (for explain), and the slices
    of the A cat that other readers took in place of an operand ({slice: operand})."""

    views: list
    tree: tuple
    name: str
    slices: dict


def copy_bytes(mm: Node, as_parts: bool = False) -> int:
    """Bytes the concat-K copies of this matmul write per call (0: not a concat-K matmul):
    what the cost model charges an op of ours (tuner.model.RegionShape.copy_bytes).  As K
    parts (as_parts and `operand_parts`): what `fused` copies, every operand and the stacked weights;
    else (the fused form stays in the graph) the stacked weights and each A operand Inductor
    cannot compute in its slice (module docstring)."""
    if META not in mm.meta:
        return 0
    cat_a, cat_w = mm.args[:2]
    every = as_parts and operand_parts(mm) is not None  # fused concatenates them all
    copied = [x for x in cat_a.args[0] if every or not _in_place(x, cat_a)]
    return sum(size_hint(v.numel()) * v.element_size() for v in map(val, [*copied, cat_w]))


def operand_parts(mm: Node) -> list[tuple[Node, Node]] | None:
    """The (A operand, weight) terms of a concat-K matmul whose cats are still as concat_k
    made them, i.e. the op can take the terms as K parts (None: not a concat-K matmul, or
    changed since)."""
    if META not in mm.meta:
        return None
    cat_a, cat_w = mm.args[:2]
    if any(c.target is not aten.cat.default for c in (cat_a, cat_w)) or set(cat_w.users) != {mm}:
        return None
    if set(cat_a.users) != {mm, *mm.meta[META].slices}:
        return None
    return list(zip(cat_a.args[0], cat_w.args[0]))


def k_parts(mm: Node) -> tuple[int, ...]:
    """The K of each term where the op takes them as K parts (RegionShape.k_parts; () : not)."""
    terms = operand_parts(mm)
    return tuple(size_hint(val(x).shape[-1]) for x, _ in terms) if terms else ()


def parts_pay(mm: Node) -> bool:
    """Config.k_parts="auto": whether the op takes this concat-K matmul's terms as K parts,
    i.e. whether the parts move fewer bytes than the cats (`parts_cheaper`)."""
    terms = operand_parts(mm)
    if not terms:
        return False
    out, cat_a = val(mm), mm.args[0]
    copied = sum(size_hint(val(x).numel()) * val(x).element_size() for x, _ in terms if not _in_place(x, cat_a))
    stacked = size_hint(val(mm.args[1]).numel()) * val(mm.args[1]).element_size()
    m, n = size_hint(out.numel()) // size_hint(out.shape[-1]), size_hint(out.shape[-1])
    return parts_cheaper(m, n, out.element_size(), len(terms), stacked + copied)


def parts_cheaper(m: int, n: int, out_bytes: int, terms: int, cat_bytes: int) -> bool:
    """K parts against the cats, in bytes moved per call.  The parts: every term after the
    first is a GEMM that reads and writes the (m, n) product again (beta = 1).  The cats: the
    stacked weights and each A operand Inductor cannot compute in its slice (cat_bytes) are
    read and written once more.  At a Llama-3-8B layer's TP=2 backward (8192 rows) the w1/w3
    sum (two terms of K 7168, stacked weights 117 MB) takes parts (134 MB of product traffic
    against 235 MB of weight copy), the q/k/v sum (three terms of K 2048/512/512, 25 MB) keeps
    its cats (268 MB against 50 MB), and a decode step's short rows always take parts.  Not
    counted, and only in the parts' favour: a pointwise producer writing into its slice of the
    cat can run slower than on its own (SwiGLU's backward: docs/architecture.md, "Measurements
    behind the constants")."""
    return (terms - 1) * 2 * m * n * out_bytes < 2 * cat_bytes


def drop_cats(graph: Graph, cat_a: Node, cat_w: Node, undo: "_Undo") -> None:
    """After the op took the terms as K parts (and the matmul is gone): the operands' other
    readers take their operands back, and both cats leave the graph."""
    _restore_slices(graph, undo.slices)
    for cat in (cat_w, cat_a):
        if not cat.users:
            graph.erase_node(cat)


def _restore_slices(graph: Graph, slices: dict[Node, Node]) -> None:
    """Every reader of a slice of the A cat reads its operand again; the slices are erased."""
    for sl, x in slices.items():
        for user in list(sl.users):
            user.replace_input_with(sl, x)
            set_fake_val(user)
        graph.erase_node(sl)


def _in_place(x: Node, cat: Node) -> bool:
    """Whether Inductor writes `x` straight into the cat: a pointwise result (through views),
    read by nothing else."""
    while len(x.users) == 1 and x.op == "call_function":
        if torch.Tag.pointwise in getattr(x.target, "tags", ()):
            return True
        if x.target not in RESHAPES:
            return False
        x = x.args[0]
    return False


def kept_bytes(mm: Node) -> int:
    """What the summed form adds to one matmul where the region is kept as compiled: each add
    reads two products and writes one, charged as a device copy of 1.5 products
    (tuner.model.RegionShape.kept_bytes; 0: not a concat-K matmul)."""
    if META not in mm.meta:
        return 0
    out = val(mm)
    terms = len(mm.meta[META].views)
    return int(1.5 * (terms - 1) * size_hint(out.numel()) * out.element_size())


def undo_unclaimed(graph: Graph) -> list[str]:
    """Restore the sum of matmuls wherever a concat-K matmul is still in the graph, i.e. no
    op of ours consumed it (the region rewrite erases the matmul it takes).  One note each."""
    notes = []
    for mm in [n for n in graph.nodes if n.op == "call_function" and n.target is MM and META in n.meta]:
        if _undo(graph, mm):
            notes.append(f"concat-K undone at {mm.meta[META].name}: its region was kept as compiled, so the sum of "
                         "matmuls is restored (the fused form only pays inside an op of ours)")
    return notes


def _undo(graph: Graph, mm: Node) -> bool:
    """Replace the fused mm (and its view) by the original add tree; False if the fused form
    was changed since (then it stays as it is: still exact)."""
    undo, (cat_a, cat_w) = mm.meta[META], mm.args
    if any(sl not in cat_a.users for sl in undo.slices):
        return False
    _restore_slices(graph, undo.slices)  # the other readers take their operand back
    fused = [cat_a, cat_w]
    if any(c.target is not aten.cat.default or len(c.users) != 1 for c in fused):
        return False
    out = mm
    if undo.views[0] is not None:
        if len(mm.users) != 1 or (out := next(iter(mm.users))).target is not undo.views[0][0]:
            return False
    with graph.inserting_before(out):
        leaves = []
        for a, w, view in zip(cat_a.args[0], cat_w.args[0], undo.views):
            term = graph.call_function(MM, (a, w))
            set_fake_val(term)
            if view is not None:
                term = graph.call_function(view[0], (term, *view[1]), view[2])
                set_fake_val(term)
            leaves.append(term)
        total = _build_sum(graph, undo.tree, leaves)
    out.replace_all_uses_with(total)
    for node in (out, mm, cat_w, cat_a) if out is not mm else (mm, cat_w, cat_a):
        graph.erase_node(node)
    return True


def _build_sum(graph: Graph, tree, leaves: list[Node]) -> Node:
    if isinstance(tree, int):
        return leaves[tree]
    node = graph.call_function(ADD, tuple(_build_sum(graph, t, leaves) for t in tree))
    set_fake_val(node)
    return node
