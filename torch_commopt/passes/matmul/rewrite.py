"""The only mutating step: replace each chosen region by one call of its commopt op.

ag_matmul: op(a_shard, weights, biases) returns each matmul's output in the gathered
layout; each consumer's row-preserving chain is replayed on it (last dim K -> N), so the
replacement has exactly the consumer's shape.  matmul_rs / matmul_ar: the chain from the
matmul to the collective is replayed on the A operand (N -> K) and the op computes the
product and the reduction from there; with Config.k_parts a concat-K matmul
(passes/matmul/concat_k.py) is handed to the op as its terms (K parts), its cats taken out again.
Float8 matmuls (torch._scaled_mm) pass their scales, output dtype and accumulation mode on to
the op.  Region nodes left without users are erased.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from torch_commopt.core.schedule import Schedule
from torch_commopt.passes.chains import replay_chain, set_fake_val
from torch_commopt.passes.graph_utils import row_shape
from torch_commopt.passes.matmul.concat_k import META as CONCAT_K
from torch_commopt.passes.matmul.concat_k import drop_cats, operand_parts
from torch_commopt.passes.regions import Region


def rewrite_region(graph: Graph, region: Region, schedule: Schedule, replaced: dict[Node, Node], *,
                   k_parts: bool = False) -> None:
    """Rewrite one region.  `replaced` maps the nodes earlier rewrites removed to what took
    their place (one region's output can be the next one's input: AG -> mm -> mm -> RS), and
    is updated with this region's replacements.  k_parts: a concat-K matmul's op takes its
    terms (Config.k_parts)."""
    if region.kind == "ag_matmul":
        _rewrite_ag_matmul(graph, region, schedule, replaced)
    else:
        _rewrite_matmul_reduce(graph, region, schedule, replaced, k_parts)


def _now(node, replaced: dict[Node, Node]):
    """What stands for `node` after the rewrites so far (None and non-nodes pass through)."""
    while isinstance(node, Node) and node in replaced:
        node = replaced[node]
    return node


def _call(graph: Graph, target, args, kwargs: dict | None = None) -> Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    set_fake_val(node)
    return node


def _rewrite_ag_matmul(graph: Graph, region: Region, schedule: Schedule, replaced: dict[Node, Node]) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((c.node for c in region.consumers), key=order.__getitem__)
    with graph.inserting_before(first):
        a = _now(region.a, replaced)
        if region.a_view is not None:  # float8 bytes gathered as uint8: the op takes them as float8
            a = _call(graph, torch.ops.aten.view.dtype, (a, region.a_view))
        args = (
            a,
            [_now(c.weight, replaced) for c in region.consumers],
            [_now(c.bias, replaced) for c in region.consumers],
            region.dim,
            region.group_size,
            region.group_name,
            str(schedule),
            region.keep_gathered,
        )
        if region.scaled is not None:
            sc = region.scaled
            args += (_now(sc.a_scale, replaced), [_now(c.scaled.b_scale, replaced) for c in region.consumers],
                     sc.out_dtype, sc.fast_accum)
        op = _call(graph, torch.ops.commopt.ag_matmul.default, args)
    k = row_shape(region.root)[-1]
    for i, consumer in enumerate(region.consumers):
        with graph.inserting_before(consumer.node):
            out = _call(graph, operator.getitem, (op, i))
            n = row_shape(consumer.node)[-1]
            replacement = replay_chain(graph, out, consumer.path, k, n)
        consumer.node.replace_all_uses_with(replacement)
        replaced[consumer.node] = replacement
        graph.erase_node(consumer.node)
        erase_dead(graph, consumer.path)
    if region.keep_gathered:
        with graph.inserting_after(op):
            gathered = _call(graph, operator.getitem, (op, len(region.consumers)))
        region.root.replace_all_uses_with(gathered)
    erase_dead(graph, region.nodes)


def _rewrite_matmul_reduce(graph: Graph, region: Region, schedule: Schedule, replaced: dict[Node, Node],
                           k_parts: bool) -> None:
    (consumer,) = region.consumers
    n = row_shape(consumer.node)[-1]
    bias = _now(consumer.bias, replaced)
    # concat-K's terms as the op's K parts (their cats go once the matmul is gone), or (A, weight)
    split = operand_parts(consumer.node) if k_parts and consumer.scaled is None else None
    terms = split or [(region.a, consumer.weight)]
    if split:  # read before the matmul is erased (erase_node clears its args)
        cats = (*consumer.node.args[:2], consumer.node.meta[CONCAT_K])
    with graph.inserting_before(region.wait):
        # the chain from the matmul to the collective, replayed on each A operand (N -> its K)
        (a, weight), *more = [(replay_chain(graph, _now(x, replaced), region.path, n, row_shape(x)[-1]),
                               _now(w, replaced)) for x, w in terms]
        parts = {"more_a": [x for x, _ in more], "more_w": [w for _, w in more]} if more else None
        if region.kind == "matmul_rs":
            args = (a, weight, bias, region.dim, region.reduce_op,
                    region.group_size, region.group_name, str(schedule))
            op = _call(graph, torch.ops.commopt.matmul_rs.default, args + _scaled_args(consumer, replaced), parts)
        else:
            args = (a, weight, bias, region.reduce_op,
                    region.group_size, region.group_name, str(schedule))
            op = _call(graph, torch.ops.commopt.matmul_ar.default, args + _scaled_args(consumer, replaced), parts)
    region.wait.replace_all_uses_with(op)
    replaced[region.wait] = op
    erase_dead(graph, region.nodes)
    if split:
        drop_cats(graph, *cats)


def _scaled_args(consumer, replaced: dict[Node, Node]) -> tuple:
    """A reduction's float8 arguments (a_scale, b_scale, out_dtype, fast_accum), if any."""
    sc = consumer.scaled
    return () if sc is None else (_now(sc.a_scale, replaced), _now(sc.b_scale, replaced), sc.out_dtype, sc.fast_accum)


def erase_dead(graph: Graph, nodes) -> None:
    """Erase the given nodes that have no users left, last first (users before producers)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted({n for n in nodes if n in order}, key=order.__getitem__, reverse=True):
        if not node.users and node.op == "call_function":
            graph.erase_node(node)
