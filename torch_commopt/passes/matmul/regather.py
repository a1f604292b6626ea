"""Save the shard, not the gathered activation, for backward (Config.regather_for_backward).

In a sequence-parallel block the forward all-gathers each norm's output (W times the shard)
into the q/k/v and w1/w3 matmuls, and the weight gradients of those matmuls need the gathered
input again: AOT autograd's partitioner saves the gathered tensor, W times the shard's memory
per layer.  This joint-graph pass marks each forward all-gather -- the collective, its wait
and the relayout that DTensor/funcol emit for a gather along dim > 0 (split, getitem, cat,
views) -- as MUST_RECOMPUTE, so the partitioner saves the shard and the backward graph
gathers it again (one more all-gather per region, which the finders then treat like any
other; the weight-gradient matmul contracts the gathered rows, so it runs as NCCL + GEMM).
The trade: (W-1)/W of each gathered activation's memory against one all-gather in backward.
With Config.saved_gather_budget_mib instead, the pass chooses which gathers to re-gather: the
least predicted backward time whose kept gathered results fit the budget (choose_regather, an
exact search over the gathers' two options).

Only forward gathers are marked (those that do not depend on a tangent); the backward's own
all-gathers are left alone.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import ALL_GATHER, WAIT, aten, group_name_of, size_hint, val

log = logging.getLogger("torch_commopt.passes.matmul.regather")

RELAYOUT = {WAIT, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.split.Tensor,
            aten.split_with_sizes.default, aten.chunk.default, aten.cat.default, aten.permute.default,
            aten.clone.default, aten.t.default, aten.transpose.int, aten.slice.Tensor, operator.getitem}


def mark_regather(graph: Graph, only: set[str] | None = None) -> list[str]:
    """Mark every forward all-gather (with its wait and relayout) MUST_RECOMPUTE, or those
    named in `only`; one note per all-gather: its name and the bytes its gathered result
    would have kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    notes = []
    for node in forward_gathers(graph):
        if only is not None and node.name not in only:
            continue
        marked = _chain(node)
        for n in marked:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        notes.append(f"{node.name}: re-gathered in backward ({len(marked)} node(s) marked; the gathered "
                     f"result holds {_nbytes(node) / 2**20:.1f} MiB)")
    for note in notes:
        log.info("commopt regather: %s", note)
    return notes


def forward_gathers(graph: Graph, backward: set[Node] | None = None) -> list[Node]:
    """The joint graph's forward all-gathers (those that do not depend on a tangent);
    backward: the tangent-dependent nodes, when the caller has them."""
    backward = _tangent_dependent(graph) if backward is None else backward
    return [n for n in graph.nodes if n.op == "call_function" and n.target is ALL_GATHER and n not in backward]


def choose_regather(graph: Graph, budget_mib: float, cache_dir: str | None = None,
                    timeout_s: float = 300.0) -> tuple[set[str], str]:
    """(names of the forward all-gathers to re-gather, a note): the least predicted backward
    time such that the gathered results kept for backward fit `budget_mib` per GPU.

    A gathered result the backward uses costs (W-1)/W of its bytes over the shard the
    partitioner would save instead; re-gathering it costs one all-gather of it in backward
    (tuner/model.collective_time with the machine's calibration, else the priors).  One
    search node per gather, two options, solved exactly (reshard/search.py)."""
    from torch_commopt.reshard.problem import Problem
    from torch_commopt.reshard.search import solve

    backward = _tangent_dependent(graph)
    options = {}
    for node in forward_gathers(graph, backward):
        if not any(u in backward for n in _chain(node) for u in n.users):
            continue  # the backward does not read it: nothing is kept either way
        world = int(node.args[1])
        full = _nbytes(node)
        options[node.name] = [(0.0, full * (world - 1) / world / 2**20),
                              (_gather_ms(node, full, world, cache_dir, timeout_s), 0.0)]
    if not options:
        return set(), "no forward all-gather is kept for backward"
    plan = solve(Problem(options), budget_mib)
    chosen = {n for n, i in plan.choice.items() if i == 1}
    kept = sum(options[n][0][1] for n in options) - plan.memory
    return chosen, (f"saved gathers within {budget_mib:g} MiB: re-gather {len(chosen)} of {len(options)} "
                    f"(predicted +{plan.time:.3f} ms in backward, {kept:.1f} MiB freed, {plan.memory:.1f} MiB kept)")


def _gather_ms(node: Node, full_bytes: int, world: int, cache_dir: str | None, timeout_s: float) -> float:
    from torch_commopt.tuner.machine import calibration_for
    from torch_commopt.tuner.matmul.model import collective_time

    cal = calibration_for(val(node).device, world, group_name_of(node.args[2]), cache_dir, timeout_s)
    return 1e3 * collective_time(cal, "all_gather", full_bytes, world)


def _nbytes(node: Node) -> int:
    """The bytes of the node's value (a dynamic size: at the size it was traced with)."""
    out = val(node)
    return size_hint(out.numel()) * out.element_size() if isinstance(out, torch.Tensor) else 0


def _chain(gather: Node) -> list[Node]:
    """The all-gather and what only relayouts its result (up to the consumers)."""
    out, todo = [], [gather]
    while todo:
        node = todo.pop()
        out.append(node)
        todo += [u for u in node.users if u.op == "call_function" and u.target in RELAYOUT and u not in out]
    return out


def _tangent_dependent(graph: Graph) -> set[Node]:
    """Nodes computed from a tangent input of the joint graph (the backward part)."""
    seen = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in graph.nodes:  # topological order: one pass
        if node not in seen and any(isinstance(a, Node) and a in seen for a in node.all_input_nodes):
            seen.add(node)
    return seen
