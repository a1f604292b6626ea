"""A Ulysses region (detect.py's "ulysses" form) as one cp_attention_fwd: inference graphs here,
training in ulysses_joint.py (which reuses the Algebra below).

The program's q, k, v go through layout ops, an all-to-all (sequence -> heads), layout ops,
attention over the full sequence on H/W heads, and back the mirrored way.  With flex_attention
(form "flex_ulysses") the op is cp_flex_attention_fwd with the program's whole-sequence mask, and
the sequence must be rank-major as for a causal mask.  The rewrite takes
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

from torch_commopt.passes.attention.detect import AttentionRegion
from torch_commopt.passes.attention.layout import Atoms, Layout, Relayout, relayout
from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import Unsupported, aten, static_shape, val


@dataclass(frozen=True)
class UlyssesPlan:
    """inputs: q/k/v before their all-to-all -> the op's (B, H(_kv), S_loc, D);
    output: the op's out (B, H, S_loc, Dv) -> what the output all-to-all's wait holds."""

    inputs: dict[str, Relayout]
    output: Relayout


def plan(region: AttentionRegion) -> UlyssesPlan:
    """Raises Unsupported where the region's element movement is not a relayout of the op's."""
    algebra = Algebra(region.world, positions(region))
    for i, key in enumerate("qkv"):
        algebra.operand(key, region.inputs[key], region.paths[f"{key}_pre"], region.collectives[i],
                        region.paths[f"{key}_post"])
    inputs = {key: algebra.to_op[key] for key in "qkv"}
    out_in = region.paths["out"][0].args[0] if region.paths["out"] else region.collectives[3].args[0]
    output = algebra.result("out", "q", static_shape(out_in)[-1], region.paths["out"], region.output)
    return UlyssesPlan(inputs, output)


def positions(region: AttentionRegion) -> bool:
    """Whether the op must see the sequence rank-major: a causal mask, or a flex mask (its
    positions are the program's, and the op's ranks own contiguous shares of them)."""
    return region.causal or region.flex is not None


class Algebra:
    """The layout algebra of one Ulysses region: operands in (to_op: the program's tensor ->
    the op's layout), results out (the op's layout -> the tensor the program's all-to-all
    delivered)."""

    def __init__(self, world: int, causal: bool) -> None:
        self.atoms, self.world, self.causal = Atoms(), world, causal
        self.owner = self.atoms.new("R", world)  # the rank that holds a sequence shard in the program
        self.ends: dict[str, Layout] = {}  # the attention operand's layout, per operand
        self.op_dims: dict[str, list[list[str]]] = {}  # the op's (B, H, S_loc, D) dims, per operand
        self.to_op: dict[str, Relayout] = {}

    def operand(self, key: str, x: Node, pre: list[Node], a2a: Node, post: list[Node]) -> None:
        """x -> pre -> all-to-all -> post -> the attention's operand `key` (B, H/W, S, D)."""
        start = Layout.fresh(self.atoms, key, static_shape(x), self.owner)
        lay = start.through(pre).all_to_all(self.world)
        if lay.shape() != list(static_shape(a2a)):
            raise Unsupported(f"{a2a.name}: the all-to-all's shape is not its input's")
        end = lay.through(post)
        if len(end.dims) != 4:
            raise Unsupported(f"attention operand {key} is not 4-D")
        self.ends[key] = end
        self.op_dims[key] = [end.dims[0], end.rank + end.dims[1], self._local_seq(end.dims[2], key), end.dims[3]]
        self.to_op[key] = relayout(self.atoms, _flat(start.dims), self.op_dims[key])

    def same_positions(self, a: str, b: str) -> None:
        """Operands a and b must order their sequence positions alike (an output and its gradient)."""
        sig = {k: [(f in self.atoms.leaves(self.owner), self.atoms.sizes[f])
                   for f in self.atoms.leaves(self.ends[k].dims[2])] for k in (a, b)}
        if sig[a] != sig[b]:
            raise Unsupported(f"{a} and {b} lay the sequence out differently")

    def result(self, name: str, like: str, last_dim: int, path: list[Node], delivered: Node) -> Relayout:
        """A result with operand `like`'s (B, H/W, S) and `last_dim` -> path -> all-to-all ->
        `delivered` (its wait): the relayout from the op's layout to `delivered`."""
        end = self.ends[like]
        last = self.atoms.new(f"{name}.d", last_dim) if last_dim != end.shape()[3] else end.dims[3]
        att = Layout(self.atoms, end.dims[:3] + [last], end.rank)
        if path and att.shape() != list(static_shape(path[0].args[0])):
            raise Unsupported(f"{name}: {list(static_shape(path[0].args[0]))} is not {like}'s (B, H/W, S) with its "
                              "last dim")
        back = att.through(path).all_to_all(self.world)
        if back.shape() != list(static_shape(delivered)):
            raise Unsupported(f"{name}: the all-to-all's shape is not its input's")
        if self.atoms.leaves(back.rank) != self.atoms.leaves(self.owner):
            raise Unsupported(f"{name}: the all-to-all does not return each rank its own sequence shard")
        return relayout(self.atoms, _flat(self.op_dims[like][:3] + [last]), back.dims)

    def _local_seq(self, seq: list[str], key: str) -> list[str]:
        return _local_seq(self.atoms, seq, self.owner, self.causal, key)


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


def apply(graph: Graph, region: AttentionRegion, ulysses: UlyssesPlan, schedule: str,
          flex_args: tuple | None = None) -> Node:
    """Insert the op before the attention, route the output all-to-all's users to its result,
    and return the op's node (the replaced nodes are erased by the caller).  flex_args: a flex
    region's op arguments after the tensors (rewrite.flex_arguments)."""
    with graph.inserting_before(region.attention):
        q, k, v = (emit(graph, region.inputs[key], ulysses.inputs[key]) for key in "qkv")
        if region.flex is not None:  # flex_attention: the whole sequence's mask, each rank its rows of it
            cp = add_node(graph, torch.ops.commopt.cp_flex_attention_fwd.default, (q, k, v, *flex_args))
        else:
            cp = add_node(graph, torch.ops.commopt.cp_attention_fwd.default,
                          (q, k, v, schedule, region.causal, region.scale, region.world, region.group_name))
        out = add_node(graph, operator.getitem, (cp, 0))
        result = emit(graph, out, ulysses.output)
    region.output.replace_all_uses_with(result)
    return cp


def emit(graph: Graph, x: Node, how: Relayout) -> Node:
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
        x = add_node(graph, target, (x, *args), kwargs)
    return x
