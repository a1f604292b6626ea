"""CoCoNet reorder: an all-gather moved after the unary ops that consume it.

    wait(all_gather(x)) -> f1 -> f2 -> ... -> fk -> (matmul, ...)
becomes
    wait(all_gather(fk(...f1(x)))) -> (matmul, ...)

when every f is a unary elementwise op (a dtype cast that does not widen, relu/gelu/silu/
sigmoid/tanh/neg) and each value in the chain but the last has exactly one user.  The ops then run on 1/W of the rows, a cast
to a narrower dtype halves what travels, and the gather lands next to the matmul, where the
all-gather -> matmul finder turns the pair into an overlapped region.  Exact: these ops
commute with concatenation.  Ops with a second operand (a bias add, a scale) are left
alone even though CoCoNet would move them: moving them is exact only if the operand is the
same on every rank, which a post-grad graph cannot show (after the move each rank would
apply its own operand to its own rows only; found by the gloo test with per-rank biases).
Runs on every graph (forward and backward) when Config.coconet is on.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import ALL_GATHER, WAIT, aten, only_user, val

log = logging.getLogger("torch_commopt.passes.matmul.coconet")

UNARY = {
    torch.ops.prims.convert_element_type.default, aten.relu.default, aten.gelu.default, aten.silu.default,
    aten.neg.default, aten.sigmoid.default, aten.tanh.default,
}


def _movable(node: Node, src: Node) -> bool:
    """Whether `node` is a unary elementwise op of `src` (no other tensor or value operand)
    that does not widen the dtype (gathering the wider result would move more bytes)."""
    if node.op != "call_function" or node.target not in UNARY or node.args[0] is not src:
        return False
    out, into = val(node), val(src)
    if out is None or into is None or out.element_size() > into.element_size():
        return False
    return not any(isinstance(a, Node) for a in list(node.args[1:]) + list(node.kwargs.values()))


def reorder_all_gathers(graph: Graph) -> list[str]:
    """Apply the reorder wherever it holds; one note per moved all-gather."""
    notes = []
    for ag in [n for n in graph.nodes if n.op == "call_function" and n.target is ALL_GATHER]:
        wait = only_user(ag)
        if wait is None or wait.target is not WAIT or val(ag.args[0]) is None:
            continue
        chain, cur = [], wait
        while True:
            nxt = only_user(cur)
            if nxt is None or not _movable(nxt, cur):
                break
            chain.append(nxt)
            cur = nxt
        if not chain:
            continue
        _move(graph, ag, wait, chain)
        notes.append(f"{ag.name}: all-gather moved after {', '.join(str(n.target).split('.')[-2] for n in chain)} "
                     "(CoCoNet reorder: the ops run on the shard)")
    return notes


def _move(graph: Graph, ag: Node, wait: Node, chain: list[Node]) -> None:
    """Rebuild the chain on the shard, gather its result, and let it replace the chain's end.
    The new nodes' fake values are computed first (what can fail), then the graph is edited;
    the nodes go just before the chain's last op, where every operand of the chain exists."""
    fakes, cur, prev = [], val(ag.args[0]), wait
    for op in chain:
        cur = op.target(*[cur if a is prev else val(a) if isinstance(a, Node) else a for a in op.args], **op.kwargs)
        fakes.append(cur)
        prev = op
    gathered_fake = ALL_GATHER(cur, *ag.args[1:], **ag.kwargs)
    shard, prev = ag.args[0], wait
    with graph.inserting_before(chain[-1]):
        for op, fake in zip(chain, fakes):
            new = graph.call_function(op.target, tuple(shard if a is prev else a for a in op.args), dict(op.kwargs))
            new.meta["val"] = fake
            shard, prev = new, op
        gathered = graph.call_function(ALL_GATHER, (shard, *ag.args[1:]), dict(ag.kwargs))
        gathered.meta["val"] = gathered_fake
        waited = graph.call_function(WAIT, (gathered,))
        waited.meta["val"] = val(chain[-1])
    chain[-1].replace_all_uses_with(waited)
    for node in reversed(chain):
        graph.erase_node(node)
    graph.erase_node(wait)
    graph.erase_node(ag)
