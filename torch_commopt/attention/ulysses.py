"""A Ulysses region (detect.py's "ulysses" form) as one cp_attention_fwd, inference graphs.

The program's q, k, v go through layout ops, an all-to-all (sequence -> heads), layout ops,
attention over the full sequence on H/W heads, and back the mirrored way.  The rewrite takes
the rank's q, k, v before their all-to-alls, brings them to the op's (B, H, S_loc, D) layout,
runs cp_attention_fwd with the schedule the cost model ranks first (ulysses itself, a ring,
hybrid, all-gather), and brings its output to the layout the output all-to-all delivered; the
four all-to-alls and the attention go.  Why: the op's schedules include ones the program
cannot choose itself (a ring when H_kv < W or the link is slow, one collective for q, k, v).

Both relayouts come from the layout algebra (layout.py), exactly: the global head index is
(head-group rank, local head) -- which keeps GQA's query-to-kv-head grouping -- and the
sequence is (sequence-owner rank, local position), which must be its outer factor when the
attention is causal (the op's causal mask is over rank-major positions).  Anything the
algebra cannot follow leaves the region alone with the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from torch_commopt.attention.detect import AttentionRegion
from torch_commopt.attention.layout import Atoms, Layout, Relayout, relayout
from torch_commopt.passes.chains import set_fake_val
from torch_commopt.passes.graph_utils import Unsupported, aten, static_shape, val


@dataclass(frozen=True)
class UlyssesPlan:
    """inputs: q/k/v before their all-to-all -> the op's (B, H(_kv), S_loc, D);
    output: the op's out (B, H, S_loc, Dv) -> what the output all-to-all's wait holds."""

    inputs: dict[str, Relayout]
    output: Relayout


def plan(region: AttentionRegion) -> UlyssesPlan:
    """Raises Unsupported where the region's element movement is not a relayout of the op's."""
    atoms, world = Atoms(), region.world
    owner = atoms.new("R", world)  # the rank that holds a sequence shard in the program
    starts, ends = {}, {}
    for i, key in enumerate("qkv"):
        x, a2a = region.inputs[key], region.collectives[i]
        starts[key] = Layout.fresh(atoms, key, static_shape(x), owner)
        lay = starts[key].through(region.paths[f"{key}_pre"]).all_to_all(world)
        if lay.shape() != list(static_shape(a2a)):
            raise Unsupported(f"{a2a.name}: the all-to-all's shape is not its input's")
        ends[key] = lay.through(region.paths[f"{key}_post"])
        if len(ends[key].dims) != 4:
            raise Unsupported(f"attention operand {key} is not 4-D")
    q_end = ends["q"]
    local_seq = {key: _local_seq(atoms, ends[key].dims[2], owner, region.causal, key) for key in "qkv"}
    targets = {key: [ends[key].dims[0], ends[key].rank + ends[key].dims[1], local_seq[key], ends[key].dims[3]]
               for key in "qkv"}
    inputs = {key: relayout(atoms, _flat(starts[key].dims), targets[key]) for key in "qkv"}

    out_shape = static_shape(region.paths["out"][0].args[0] if region.paths["out"] else region.collectives[3].args[0])
    dv = atoms.new("dv", out_shape[-1])
    att = Layout(atoms, q_end.dims[:3] + [dv], q_end.rank)
    if att.shape() != list(out_shape):
        raise Unsupported(f"attention output {list(out_shape)} is not q's (B, H/W, S) with its head dim")
    back = att.through(region.paths["out"]).all_to_all(world)
    if back.shape() != list(static_shape(region.output)):
        raise Unsupported("the output all-to-all's shape is not its input's")
    if atoms.leaves(back.rank) != atoms.leaves(owner):
        raise Unsupported("the output all-to-all does not return each rank its own sequence shard")
    canonical_out = targets["q"][:3] + [dv]
    output = relayout(atoms, _flat(canonical_out), back.dims)
    return UlyssesPlan(inputs, output)


def _flat(dims: list[list[str]]) -> list[str]:
    return [f for d in dims for f in d]


def _local_seq(atoms: Atoms, seq: list[str], owner: list[str], causal: bool, key: str) -> list[str]:
    """The factors of a rank's own positions: the attention's sequence without the owner rank."""
    seq, own = atoms.leaves(seq), atoms.leaves(owner)
    if not set(own) <= set(seq):
        raise Unsupported(f"{key}: the attention's sequence dim does not span the ranks' shards")
    if causal and seq[: len(own)] != own:
        raise Unsupported(f"{key}: the sequence is not rank-major (the ranks' shards interleave), which a causal "
                          "mask over the op's contiguous layout would get wrong")
    return [f for f in seq if f not in own]


def apply(graph: Graph, region: AttentionRegion, ulysses: UlyssesPlan, schedule: str) -> Node:
    """Insert the op before the attention, route the output all-to-all's users to its result,
    and return the op's node (the replaced nodes are erased by the caller)."""
    with graph.inserting_before(region.attention):
        q, k, v = (_emit(graph, region.inputs[key], ulysses.inputs[key]) for key in "qkv")
        cp = graph.call_function(torch.ops.commopt.cp_attention_fwd.default,
                                 (q, k, v, schedule, region.causal, region.scale, region.world, region.group_name))
        set_fake_val(cp)
        out = graph.call_function(operator.getitem, (cp, 0))
        set_fake_val(out)
        result = _emit(graph, out, ulysses.output)
    region.output.replace_all_uses_with(result)
    return cp


def _emit(graph: Graph, x: Node, how: Relayout) -> Node:
    """x.reshape(split).permute(order), contiguous, viewed as the target shape."""
    if how.is_identity() and tuple(static_shape(x)) == how.shape:
        return x
    steps = [] if val(x).is_contiguous() else [(aten.clone.default, (), {"memory_format": torch.contiguous_format})]
    steps.append((aten.view.default, (list(how.split),), {}))
    if not how.is_identity():
        steps += [(aten.permute.default, (list(how.order),), {}),
                  (aten.clone.default, (), {"memory_format": torch.contiguous_format})]
    steps.append((aten.view.default, (list(how.shape),), {}))
    for target, args, kwargs in steps:
        x = graph.call_function(target, (x, *args), kwargs)
        set_fake_val(x)
    return x
