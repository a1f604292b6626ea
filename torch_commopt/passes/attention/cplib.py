"""torch's context_parallel with FlexAttention, in the form the attention finder reads.

torch's `_ContextParallel(attention_type=FLEX)` (and torchtitan's CP with FlexAttention) gathers K
and V with its own custom op, `cplib::flex_cp_allgather(k, v, seq_dim, pg_name)`, whose
autograd backward is `cplib::flex_cp_allgather_backward(dk, dv, seq_dim, pg_name)`.  Their bodies
are functional collectives: an all-gather of each along seq_dim, and a sum reduce-scatter of each
along it.  `expand` writes both out as exactly those collectives in the form funcol emits for a dim
other than 0 (gather on dim 0, then split and cat; chunk and cat, then reduce-scatter on dim 0),
which `detect` and the joint rewrite already take.  The program's collectives are the same either
way, on every rank, whether or not a region is rewritten afterwards.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import ALL_GATHER, REDUCE_SCATTER, WAIT, aten, static_shape

GATHER, GATHER_BACKWARD = "cplib::flex_cp_allgather", "cplib::flex_cp_allgather_backward"


def _op_name(node: Node) -> str:
    name = getattr(node.target, "name", None)
    return name() if node.op == "call_function" and callable(name) else ""


def expand(graph: Graph) -> int:
    """Rewrite every cplib gather and its backward into functional collectives; how many."""
    count = 0
    for node in list(graph.nodes):
        kind = _op_name(node)
        if kind not in (GATHER, GATHER_BACKWARD):
            continue
        if any(u.target is not operator.getitem for u in node.users):
            continue  # not the two-output form: left as it is (the finder then finds no gather)
        a, b, dim, group_name = node.args
        with graph.inserting_before(node):
            outs = [(_gather if kind == GATHER else _scatter)(graph, x, dim, _world(node, x, kind), group_name)
                    for x in (a, b)]
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        count += 1
    return count


def _world(node: Node, x: Node, kind: str) -> int:
    """The group's size, from the op's shapes: its first output against its first input."""
    dim = node.args[2]
    local, out = static_shape(x), node.meta["val"][0].shape
    return int(out[dim]) // int(local[dim]) if kind == GATHER else int(local[dim]) // int(out[dim])


def _gather(graph: Graph, x: Node, dim: int, world: int, group_name) -> Node:
    """x gathered along dim: all_gather_into_tensor on dim 0, then (dim > 0) split into the ranks'
    blocks and cat along dim."""
    own = add_node(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
    whole = add_node(graph, WAIT, (add_node(graph, ALL_GATHER, (own, world, group_name)),))
    if dim == 0:
        return whole
    rows = static_shape(x)[0]
    parts = add_node(graph, aten.split.Tensor, (whole, rows, 0))
    return add_node(graph, aten.cat.default, ([add_node(graph, operator.getitem, (parts, i)) for i in range(world)], dim))


def _scatter(graph: Graph, x: Node, dim: int, world: int, group_name) -> Node:
    """x sum-reduce-scattered along dim: (dim > 0) split along dim and cat on dim 0, then
    reduce_scatter_tensor on dim 0."""
    if dim != 0:
        size = static_shape(x)[dim] // world
        parts = add_node(graph, aten.split.Tensor, (x, size, dim))
        x = add_node(graph, aten.cat.default, ([add_node(graph, operator.getitem, (parts, i)) for i in range(world)], 0))
    return add_node(graph, WAIT, (add_node(graph, REDUCE_SCATTER, (x, "sum", world, group_name)),))

