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

Only forward gathers are marked (those that do not depend on a tangent); the backward's own
all-gathers are left alone.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import ALL_GATHER, WAIT, aten, val

log = logging.getLogger("torch_commopt.passes.regather")

RELAYOUT = {WAIT, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.split.Tensor,
            aten.split_with_sizes.default, aten.chunk.default, aten.cat.default, aten.permute.default,
            aten.clone.default, aten.t.default, aten.transpose.int, aten.slice.Tensor, operator.getitem}


def mark_regather(graph: Graph) -> list[str]:
    """Mark every forward all-gather (with its wait and relayout) MUST_RECOMPUTE; one note
    per all-gather: its name and the bytes its gathered result would have kept."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = _tangent_dependent(graph)
    notes = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not ALL_GATHER or node in backward:
            continue
        marked = _chain(node)
        for n in marked:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        out = val(node)
        size = out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0
        notes.append(f"{node.name}: re-gathered in backward ({len(marked)} node(s) marked; the gathered "
                     f"result holds {size / 2**20:.1f} MiB)")
    for note in notes:
        log.info("commopt regather: %s", note)
    return notes


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


class JointPass(CustomGraphPass):
    """Inductor's joint_custom_post_pass (a CustomGraphPass: `uuid` keys Inductor's caches):
    context-parallel attention in training (attention/joint.py, pattern "attention"), then
    Config.regather_for_backward.  Its notes go to the log and to the next graph report."""

    def __init__(self, config):
        self.config = config

    def __call__(self, graph: Graph) -> None:
        notes = []
        if "attention" in self.config.patterns:
            from torch_commopt.attention.joint import rewrite_joint_attention

            try:
                timeout = self.config.consistency_timeout_s if self.config.check_rank_consistency else None
                notes += rewrite_joint_attention(graph, self.config.attention_schedule, timeout, self.config.cache_dir)
            except Exception as e:  # noqa: BLE001 - the joint graph is left as far as it got: each
                # region is edited only after it matched, so a failure leaves whole regions
                log.exception("commopt: attention rewrite of the joint graph stopped")
                notes.append(f"attention rewrite (joint graph) stopped ({type(e).__name__}: {e})")
        if self.config.regather_for_backward:
            notes += mark_regather(graph)
        for note in notes:
            log.info("commopt joint graph: %s", note)
        PENDING_NOTES.extend(notes)

    def uuid(self) -> str:
        import pathlib

        from torch._inductor.custom_graph_pass import get_hash_for_files

        files = tuple(sorted(str(p) for p in pathlib.Path(__file__).parents[1].rglob("*.py")))
        return get_hash_for_files(files, self.config.to_json()).hex()


# notes of the joint-graph pass, picked up by the report of the next graph the post-grad pass sees
PENDING_NOTES: list[str] = []
