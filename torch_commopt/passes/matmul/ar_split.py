"""CoCoNet's all-reduce split: where all_reduce -> row-local ops could become
reduce_scatter -> the same ops on 1/W of the rows -> all_gather (find_ar_splits, explain),
and the rewrite that makes it so (split_all_reduces, Config.ar_split).

    t = wait(all_reduce(mm(...)));  h = x + t;  n = rmsnorm(h) * g;  ... n @ w
could run as
    ts = wait(reduce_scatter(mm(...)));  hs = x[rows] + ts;  ns = rmsnorm(hs) * g;  n = all_gather(ns)
and then the reduce-scatter meets its matmul (matmul_rs) and the all-gather the next one
(ag_matmul): both collectives overlap a GEMM, where the all-reduce overlapped neither.

A split candidate is the largest set of nodes reachable from the all-reduce's result through
row-local ops -- elementwise ops and reductions over the last dim that keep dim 0 whole --
whose other tensor operands are either full-shaped (each rank would use its block of rows)
or broadcast along dim 0 (used as they are).  Both kinds must hold the same values on every
rank (the residual stream and the norm weight of a tensor-parallel block without sequence
parallelism), which a post-grad graph cannot show: the rewrite runs only when the user
states it (Config.ar_split; "checked" verifies it at every call).  Random ops (dropout) end a candidate: their per-rank
masks would be drawn for other rows.  The frontier is the candidate's values used outside
it; those would be all-gathered.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from torch_commopt.core.groups import resolve_group
from torch_commopt.passes.chains import set_fake_val
from torch_commopt.passes.graph_utils import (
    ADDMM,
    ALL_GATHER,
    ALL_REDUCE,
    BMM,
    MM,
    REDUCE_SCATTER,
    RESHAPES,
    WAIT,
    aten,
    group_name_of,
    is_getitem,
    only_user,
    val,
)
from torch_commopt.passes.matmul.coconet import UNARY

ELEMENTWISE = UNARY | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.maximum.default, aten.minimum.default,
    aten.where.self, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
    aten.abs.default, aten.reciprocal.default, aten.clone.default,
}
# reductions whose `dim` argument (args[1]) must leave dim 0 alone
LAST_DIM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var_mean.correction}
MATMULS = {MM, ADDMM, BMM}


@dataclass
class SplitCandidate:
    all_reduce: Node
    wait: Node
    rows: int  # size of the cut dim of the reduced tensor, cut into W blocks
    ops: list[Node] = field(default_factory=list)  # the row-local ops, graph order
    frontier: list[Node] = field(default_factory=list)  # values used outside (to gather)
    full_operands: list[Node] = field(default_factory=list)  # external, full-shaped (to slice)
    broadcast_operands: list[Node] = field(default_factory=list)  # external, no dim 0 (as is)
    from_matmul: bool = False  # the reduced value is a matmul's (matmul_rs would form)
    feeds_matmul: bool = False  # a frontier value reaches a matmul (ag_matmul would form)
    dim: int = 0  # the cut dim: the first leading dim the group's size divides

    def describe(self) -> str:
        worth = "worth it" if self.from_matmul and self.feeds_matmul else "no GEMM to overlap on both sides"
        return (f"{self.all_reduce.name}: all-reduce -> {len(self.ops)} row-local op(s) could run on 1/W of "
                f"{self.rows} rows of dim {self.dim} (reduce-scatter ... all-gather of {len(self.frontier)} value(s)); "
                f"needs {len(self.full_operands)} full and {len(self.broadcast_operands)} broadcast operand(s) "
                f"equal on every rank; {worth}")


def find_ar_splits(graph: Graph) -> list[SplitCandidate]:
    """Every sum all-reduce whose result starts a non-empty row-local region, cut along its
    first leading dim that is a multiple of the group's size (dim 0, or the sequence dim of
    a batch-1 (1, S, D) activation)."""
    out = []
    for ar in [n for n in graph.nodes if n.op == "call_function" and n.target is ALL_REDUCE]:
        wait = only_user(ar)
        reduced = val(ar.args[0])
        if wait is None or wait.target is not WAIT or reduced is None or reduced.dim() < 2 or len(ar.args) < 3:
            continue
        try:
            world = resolve_group(group_name_of(ar.args[2])).size()
        except Exception:  # noqa: BLE001 - an unknown group: not a candidate
            continue
        dims = [d for d in range(reduced.dim() - 1)
                if isinstance(reduced.shape[d], int) and reduced.shape[d] >= world and reduced.shape[d] % world == 0]
        if ar.args[1] != "sum" or not dims:
            continue
        cand = SplitCandidate(ar, wait, reduced.shape[dims[0]], from_matmul=_is_matmul_product(ar.args[0]),
                              dim=dims[0])
        _grow(cand)
        if cand.ops:
            out.append(cand)
    return out


def _grow(cand: SplitCandidate) -> None:
    order = {n: i for i, n in enumerate(cand.wait.graph.nodes)}
    inside, operands, todo = {cand.wait}, {}, [cand.wait]
    while todo:
        node = todo.pop()
        for user in list(node.users):
            kinds = None if user in inside else _row_local(user, inside, cand.rows, cand.dim)
            if kinds is None:
                continue
            inside.add(user)
            operands.update(kinds)
            todo.append(user)
            for item in user.users:  # getitem of a tuple-valued reduction (var_mean) goes with it
                if is_getitem(item) and item not in inside:
                    inside.add(item)
                    todo.append(item)
    cand.ops = sorted(inside - {cand.wait}, key=order.get)
    for node in [cand.wait] + cand.ops:
        outside = [u for u in node.users if u not in inside]
        if outside and isinstance(val(node), torch.Tensor):
            cand.frontier.append(node)
            cand.feeds_matmul |= any(_reaches_matmul(u) for u in outside)
    for a in sorted((a for a in operands if a not in inside), key=order.get):
        (cand.full_operands if operands[a] == "full" else cand.broadcast_operands).append(a)


def _row_local(node: Node, inside: set[Node], rows: int, dim: int = 0) -> dict[Node, str] | None:
    """If `node` computes each row (index along the cut dim `dim`) of its output from the same
    row of its region operands, with every other tensor operand full-shaped ("full": sliced to
    the rank's rows) or broadcast along `dim` ("broadcast": used as is): those operands and
    their kinds; else None.  Reductions must reduce only dims after the cut one."""
    if node.op != "call_function":
        return None
    out = val(node)
    if node.target in LAST_DIM_REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        src = val(node.args[0])
        if src is None or not isinstance(dims, (list, tuple)) or not dims or any(d % src.dim() <= dim for d in dims):
            return None
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
    elif node.target in ELEMENTWISE:
        outs = [out]
    else:
        return None
    if any(not isinstance(o, torch.Tensor) or o.dim() <= dim or o.shape[dim] != rows for o in outs):
        return None
    kinds = {}
    for a in _tensor_args(node):
        v = val(a)
        if v is None:
            return None
        if a in inside:
            if v.dim() != outs[0].dim():  # a row vector of the region broadcast along columns
                return None
            continue
        if _is_all_reduce_result(a):  # another all-reduce's result starts its own candidate
            return None
        if v.dim() == outs[0].dim() and v.shape[dim] == rows:
            kinds[a] = "full"
        elif v.dim() < outs[0].dim() - dim or (v.dim() == outs[0].dim() and v.shape[dim] == 1):
            kinds[a] = "broadcast"  # right-aligned, it does not span the cut dim
        else:
            return None
    return kinds


def _is_all_reduce_result(node: Node) -> bool:
    return (node.op == "call_function" and node.target is WAIT and isinstance(node.args[0], Node)
            and node.args[0].target is ALL_REDUCE)


def _tensor_args(node: Node) -> list[Node]:
    return [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, Node)]


def _is_matmul_product(node: Node) -> bool:
    while isinstance(node, Node) and node.op == "call_function" and node.target in RESHAPES:
        node = node.args[0]
    return isinstance(node, Node) and node.op == "call_function" and node.target in MATMULS


def _reaches_matmul(node: Node, depth: int = 3) -> bool:
    """The value feeds a matmul directly or through a few reshapes / dtype casts."""
    if node.op != "call_function":
        return False
    if node.target in MATMULS:
        return True
    if depth and (node.target in RESHAPES or node.target is torch.ops.prims.convert_element_type.default):
        return any(_reaches_matmul(u, depth - 1) for u in node.users)
    return False


def split_shapes(cand: SplitCandidate, world: int):
    """The candidate as reshard.ar_cost sees it: the producing GEMM, the bytes of the
    row-local ops, and per value used outside the widths of the GEMMs it feeds."""
    from torch_commopt.reshard.ar_cost import SplitShapes, op_bytes, rows_of

    reduced = val(cand.all_reduce.args[0])
    mm = cand.all_reduce.args[0]
    while mm.target in RESHAPES:
        mm = mm.args[0]
    a = mm.args[1] if mm.target is ADDMM else mm.args[0]
    outs = [val(n) for n in cand.ops]
    numels = [t.numel() for t in outs if isinstance(t, torch.Tensor)]
    gathered = tuple((val(v).shape[-1], tuple(_gemm_widths(v))) for v in cand.frontier)
    return SplitShapes(rows=rows_of(list(reduced.shape)), k=val(a).shape[-1], n=reduced.shape[-1],
                       op_bytes=op_bytes(numels, reduced.element_size()), gathered=gathered, world=world,
                       dtype=str(reduced.dtype).removeprefix("torch."))


def _gemm_widths(node: Node, depth: int = 3) -> list[int]:
    """Output widths of the matmuls `node` feeds as their left operand (through a few
    reshapes / dtype casts)."""
    out = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target in (MM, BMM) and user.args[0] is node:
            out.append(val(user).shape[-1])
        elif user.target is ADDMM and user.args[1] is node:
            out.append(val(user).shape[-1])
        elif depth and (user.target in RESHAPES or user.target is torch.ops.prims.convert_element_type.default):
            out += _gemm_widths(user, depth - 1)
    return out


# ---- the rewrite (Config.ar_split) ---------------------------------------------------------

MAX_SPLITS = 256  # per graph: each split removes an all-reduce, so this only bounds a bug


def split_all_reduces(graph: Graph, check: bool = False,
                      decide: Callable[[SplitCandidate], tuple[bool, str]] | None = None) -> list[str]:
    """Apply the split to every candidate with a GEMM on both sides that `decide` accepts
    (None: every one); one note per decision.  Candidates are found again after each split:
    a split replaces values later candidates use (a residual stream gathered by one split is
    sliced back by the next -- to the shard it came from, not through a slice of the
    gathered tensor)."""
    notes, shards, kept = [], {}, set()
    for _ in range(MAX_SPLITS):
        cand = next((c for c in find_ar_splits(graph) if c.from_matmul and c.feeds_matmul and c.all_reduce not in kept),
                    None)
        if cand is None:
            break
        if decide is not None:
            ok, why = decide(cand)
            if not ok:
                kept.add(cand.all_reduce)
                notes.append(f"{cand.all_reduce.name}: not split ({why})")
                continue
            notes.append(f"{cand.all_reduce.name}: {why}")
        _apply(graph, cand, shards, check)
        operands = ", ".join(a.name for a in cand.full_operands + cand.broadcast_operands) or "none"
        notes.append(f"{cand.all_reduce.name}: split into reduce-scatter (dim {cand.dim}) -> {len(cand.ops)} op(s) "
                     f"on the rows -> all-gather of {len(cand.frontier)} value(s); assumed equal on every rank: {operands}")
    dropped = 0
    for done in list(shards):  # gathers whose every user now takes the shard
        if not done.users:
            _erase_gather(graph, done)
            dropped += 1
    if dropped:
        notes.append(f"{dropped} all-gather(s) dropped: their values are used on the rows only")
    return notes


def _apply(graph: Graph, cand: SplitCandidate, shards: dict[Node, Node], check: bool = False) -> None:
    """Rebuild the candidate's ops on this rank's rows.  Their fake values are computed before
    the graph is edited; each new node goes just before the node it replaces, where all of
    that node's operands exist.  `shards`: gathered value -> the shard it was gathered from.
    check: the operands assumed equal on every rank are compared across ranks at each call."""
    ar = cand.all_reduce
    partial, group = ar.args[0], ar.args[2]
    gname = group_name_of(group)
    world = resolve_group(gname).size()
    full, region = set(cand.full_operands), set(cand.ops)
    fakes = _shard_fakes(cand, world, gname)  # raises before any edit

    def add(target, args, *, before=None, after=None) -> Node:
        with graph.inserting_before(before) if before is not None else graph.inserting_after(after):
            node = graph.call_function(target, args)
        set_fake_val(node)
        return node

    dim = cand.dim
    if dim:  # the funcol form of a scatter along dim > 0: W blocks of that dim stacked on dim 0
        items = _items(add, add(aten.split.Tensor, (partial, cand.rows // world, dim), after=ar), world)
        partial = add(aten.cat.default, (items, 0), after=items[-1])
    rs = add(REDUCE_SCATTER, (partial, "sum", world, group), after=partial if dim else ar)
    local = {cand.wait: add(WAIT, (rs,), after=rs)}  # original node -> its value on this rank's rows

    def operand(a, before: Node):
        if not isinstance(a, Node) or a in local:
            return local.get(a, a)
        if a in full:  # this rank's rows; a value an earlier split gathered: the shard it came from
            shard, shard_dim = shards.get(a, (None, None))
            local[a] = shard if shard_dim == dim else add(torch.ops.commopt.shard_rows.default,
                                                           (a, world, gname, check, dim), before=before)
        elif check:  # broadcast along dim 0: as is, once verified
            local[a] = add(torch.ops.commopt.replicated.default, (a, world, gname), before=before)
        else:
            return a
        return local[a]

    for op in cand.ops:
        args = tuple(operand(a, op) for a in op.args)
        kwargs = {k: operand(v, op) for k, v in op.kwargs.items()}
        with graph.inserting_before(op):
            local[op] = graph.call_function(op.target, args, kwargs)
        local[op].meta["val"] = fakes[op]
    for value in cand.frontier:
        gathered = add(ALL_GATHER, (local[value], world, group), after=local[value])
        done = add(WAIT, (gathered,), after=gathered)
        if dim:  # dim 0 holds the W blocks: put them back along the cut dim
            items = _items(add, add(aten.split.Tensor, (done, val(local[value]).shape[0], 0), after=done), world)
            done = add(aten.cat.default, (items, dim), after=items[-1])
        for user in [u for u in value.users if u not in region]:
            user.replace_input_with(value, done)
        shards[done] = (local[value], dim)
    for node in reversed([cand.wait] + cand.ops):
        graph.erase_node(node)
    graph.erase_node(ar)


def _erase_gather(graph: Graph, done: Node) -> None:
    """Erase an unused gathered value and what made it, back to (and with) its all-gather."""
    todo = [done]
    while todo:
        node = todo.pop()
        if node.users:
            continue
        todo += [] if node.target is ALL_GATHER else list(node.all_input_nodes)
        graph.erase_node(node)


def _items(add, split: Node, world: int) -> list[Node]:
    """The W getitems of a split node, in order, each right after the previous."""
    items, prev = [], split
    for i in range(world):
        prev = add(operator.getitem, (split, i), after=prev)
        items.append(prev)
    return items


def _shard_fakes(cand: SplitCandidate, world: int, group_name: str) -> dict[Node, object]:
    """The fake value of every candidate op run on this rank's rows (no graph edit)."""
    shard_rows = torch.ops.commopt.shard_rows.default
    full = set(cand.full_operands)
    rows = {cand.wait: shard_rows(val(cand.wait), world, group_name, False, cand.dim)}
    for a in full:
        rows[a] = shard_rows(val(a), world, group_name, False, cand.dim)

    def fake(a):
        if not isinstance(a, Node):
            return a
        return rows[a] if a in rows else val(a)

    for op in cand.ops:
        rows[op] = op.target(*[fake(a) for a in op.args], **{k: fake(v) for k, v in op.kwargs.items()})
    return {op: rows[op] for op in cand.ops}
