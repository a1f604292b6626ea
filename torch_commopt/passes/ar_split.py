"""CoCoNet's all-reduce split, analysis side: where all_reduce -> row-local ops could become
reduce_scatter -> the same ops on 1/W of the rows -> all_gather.

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
parallelism), which a post-grad graph cannot show: the rewrite (reshard issue) needs that
as an assumption the user states.  Random ops (dropout) end a candidate: their per-rank
masks would be drawn for other rows.  The frontier is the candidate's values used outside
it; those would be all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from torch_commopt.kernels.reference.collectives import resolve_group
from torch_commopt.passes.graph_utils import (
    ADDMM, ALL_REDUCE, BMM, MM, RESHAPES, WAIT, aten, group_name_of, is_getitem, only_user, val,
)

ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.maximum.default, aten.minimum.default,
    aten.where.self, aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default, aten.neg.default,
    aten.abs.default, aten.reciprocal.default, aten.relu.default, aten.gelu.default, aten.silu.default,
    aten.sigmoid.default, aten.tanh.default, aten.clone.default, torch.ops.prims.convert_element_type.default,
}
# reductions whose `dim` argument (args[1]) must leave dim 0 alone
LAST_DIM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var_mean.correction}
MATMULS = {MM, ADDMM, BMM}


@dataclass
class SplitCandidate:
    all_reduce: Node
    wait: Node
    rows: int  # dim 0 of the reduced tensor, cut into W blocks
    ops: list[Node] = field(default_factory=list)  # the row-local ops, graph order
    frontier: list[Node] = field(default_factory=list)  # values used outside (to gather)
    full_operands: list[Node] = field(default_factory=list)  # external, full-shaped (to slice)
    broadcast_operands: list[Node] = field(default_factory=list)  # external, no dim 0 (as is)
    from_matmul: bool = False  # the reduced value is a matmul's (matmul_rs would form)
    feeds_matmul: bool = False  # a frontier value reaches a matmul (ag_matmul would form)

    def describe(self) -> str:
        worth = "worth it" if self.from_matmul and self.feeds_matmul else "no GEMM to overlap on both sides"
        return (f"{self.all_reduce.name}: all-reduce -> {len(self.ops)} row-local op(s) could run on 1/W of "
                f"{self.rows} rows (reduce-scatter ... all-gather of {len(self.frontier)} value(s)); "
                f"needs {len(self.full_operands)} full and {len(self.broadcast_operands)} broadcast operand(s) "
                f"equal on every rank; {worth}")


def find_ar_splits(graph: Graph) -> list[SplitCandidate]:
    """Every sum all-reduce whose result starts a non-empty row-local region, with dim 0
    a multiple of the group's size."""
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
        if ar.args[1] != "sum" or not isinstance(reduced.shape[0], int) or reduced.shape[0] % world:
            continue
        cand = SplitCandidate(ar, wait, reduced.shape[0], from_matmul=_is_matmul_product(ar.args[0]))
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
            kinds = None if user in inside else _row_local(user, inside, cand.rows)
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


def _row_local(node: Node, inside: set[Node], rows: int) -> dict[Node, str] | None:
    """If `node` computes each row of its output from the same row of its region operands,
    with every other tensor operand full-shaped ("full": sliced to the rank's rows) or
    broadcast along dim 0 ("broadcast": used as is): those operands and their kinds; else None."""
    if node.op != "call_function":
        return None
    out = val(node)
    if node.target in LAST_DIM_REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        src = val(node.args[0])
        if src is None or not isinstance(dims, (list, tuple)) or not dims or any(d % src.dim() == 0 for d in dims):
            return None
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
    elif node.target in ELEMENTWISE:
        outs = [out]
    else:
        return None
    if any(not isinstance(o, torch.Tensor) or o.dim() < 1 or o.shape[0] != rows for o in outs):
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
        if v.dim() == outs[0].dim() and v.shape[0] == rows:
            kinds[a] = "full"
        elif v.dim() < outs[0].dim() or v.shape[0] == 1:  # right-aligned: does not span dim 0
            kinds[a] = "broadcast"
        else:
            return None
    return kinds


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
