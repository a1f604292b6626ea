"""Context-parallel attention in training: the rewrite on the joint graph (before AOT
autograd splits it into forward and backward), so both halves change together.

In the joint graph an all-gather CP program reads (funcol's autograd all-gather, non-causal):

    K = relayout(wait(all_gather(k)));  V = ...;  out, lse = sdpa(q, K, V)
    dq, dK, dV = sdpa_backward(dout, q, K, V, out, lse)
    dk = wait(reduce_scatter(relayout(dK)));  dv = ...        # the gathers' backward

and becomes

    out, lse = cp_attention_fwd(q, k', v')                     # k', v': k, v in (B, H_kv, S_loc, D)
    dq, dk', dv' = cp_attention_bwd(dout, q, k', v', out, lse)
    dk = inverse layout(dk');  dv = ...

so the partitioner saves q, the local k/v, out and the LSE instead of the gathered K/V, and no
all-gather or reduce-scatter of K/V runs (the schedule moves what it needs).  A schedule that
moves its inputs (ulysses, ring_zigzag: schedules.moves_inputs) runs as the kept pair,
cp_attention_fwd_keep / cp_attention_bwd_kept (rewrite.insert_training_forward).  Flex's one-group
all-gather keeps its gathered K/V for the backward as the program did (cp_flex_attention_fwd_keep /
_bwd_kept), unless the config asks the backward to gather again.  Ulysses programs
(all-to-all -> attention -> all-to-all, and the mirror in backward) go the same way through
ulysses_joint.py.  A region whose
pieces do not match exactly (another user of K or dK, an expand in the layout, a reduce-scatter
over another group) is left alone and reported.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from torch_commopt.core.attention_spec import parse_flex_schedule
from torch_commopt.kernels.attention import schedules
from torch_commopt.passes.attention import cplib, ulysses_joint
from torch_commopt.passes.attention.detect import (
    ATTENTION_BACKWARD,
    FLEX_BACKWARD,
    AttentionRegion,
    _reshaped_dim,
    find_attention,
)
from torch_commopt.passes.attention.rewrite import (
    KEEP_ULYSSES,
    _choose,
    _flex_kept,
    _local,
    describe,
    flex_arguments,
    insert_training_backward,
    insert_training_forward,
    ranks_disagree,
)
from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import REDUCE_SCATTER, WAIT, Unsupported, aten, group_name_of, static_shape

# ops between dK and its reduce-scatter: the relayout of the gather, run backwards
DRAIN = {aten.slice.Tensor, aten.cat.default, aten.split.Tensor, operator.getitem, aten.transpose.int,
         aten.permute.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
         aten.clone.default, aten.alias.default}


RESHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
INVERTIBLE = RESHAPE_OPS | {aten.transpose.int, aten.permute.default, aten.clone.default, aten.alias.default}


class NotMatched(Exception):
    """The region's backward does not have the expected shape; left alone."""


def rewrite_joint_attention(graph: Graph, schedule: str = "auto", consistency_timeout_s: float | None = None,
                            cache_dir: str | None = None, *, mode: str = "auto", top_k: int = 4,
                            tune_timeout_s: float = 300.0, keep_gathered: bool = False) -> list[str]:
    """Rewrite every all-gather CP attention of a joint graph whose backward matches; notes.
    consistency_timeout_s: check the decisions across ranks first (None: no check); mode, top_k,
    tune_timeout_s: as rewrite.rewrite_attention; keep_gathered: flex's one-group all-gather keeps
    its gathered K/V for the backward (cp_flex_attention_fwd_keep / _bwd_kept)."""
    if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes):
        return []  # an inference graph (Inductor runs joint passes on those too): rewrite.py takes it
    cplib.expand(graph)  # torch context_parallel's K/V gather op, as the collectives it runs
    regions, skips = find_attention(graph)
    notes = [f"attention {s.node}: left alone ({s.reason})" for s in skips]
    plans = {}
    for region in regions:
        if region.form == "decode_kv":
            notes.append(f"{describe(region)}: found; decoding attention is rewritten in inference graphs only")
            continue
        if region.flex is not None:
            why = _flex_kept(region)
            try:
                if why is None:
                    plans[id(region)] = _match_flex(region) if region.form == "flex_allgather_kv" else \
                        ulysses_joint.match(region)
            except (NotMatched, Unsupported) as e:
                why = f"not rewritten ({e})"
            if why is not None:
                notes.append(f"{describe(region)}: {why}")
            continue
        if region.attention.target not in ATTENTION_BACKWARD:
            notes.append(f"{describe(region)}: found; {region.form} with {region.op} is not rewritten in training "
                         "(the program keeps its own)")
            continue
        try:
            plans[id(region)] = _match(region) if region.form == "allgather_kv" else ulysses_joint.match(region)
        except (NotMatched, Unsupported) as e:
            notes.append(f"{describe(region)}: not rewritten ({e})")
    choices = {id(r): _choose(r, schedule, cache_dir, tune_timeout_s, backward=True, mode=mode, top_k=top_k,
                              kept_gathers=keep_gathered and r.form == "flex_allgather_kv")
               for r in regions if id(r) in plans}
    disagree = ranks_disagree(regions, skips, choices, consistency_timeout_s)
    if disagree:
        return notes + [disagree]
    for region in regions:
        if id(region) in plans:
            chosen, _, why = choices[id(region)]
            if region.form == "flex_ulysses":
                if chosen == KEEP_ULYSSES:
                    notes.append(f"{describe(region)}: kept, the program's Ulysses ({why})")
                else:
                    ulysses_joint.apply(graph, region, plans[id(region)], chosen)
                    notes.append(f"{describe(region)}: cp_flex_attention_fwd/bwd {chosen} in the joint graph ({why})")
                continue
            if region.form == "flex_allgather_kv":
                keep = keep_gathered and parse_flex_schedule(chosen) == ("allgather", 1)
                _apply_flex(graph, region, plans[id(region)], chosen, keep)
                form = ", gathered K/V kept for the backward" if keep else ""
                notes.append(f"{describe(region)}: cp_flex_attention_fwd/bwd {chosen} in the joint graph{form} ({why})")
                continue
            if region.form == "allgather_kv":
                _apply(graph, region, plans[id(region)], chosen)
            else:
                ulysses_joint.apply(graph, region, plans[id(region)], chosen)
            kept = schedules.moves_inputs(chosen, region.world, region.causal)
            form = ", kept form: the backward moves dout alone" if kept else ""
            notes.append(f"{describe(region)}: cp_attention_fwd/bwd {chosen} in the joint graph{form} ({why})")
    return notes


def _match(region: AttentionRegion) -> dict:
    """The backward op, its dq getitem and, per K/V, the reduce-scatter's wait that delivers
    the gradient of the gathered shard."""
    fwd = region.attention
    key, value = fwd.args[1], fwd.args[2]
    bwds = [u for u in key.users if u.target is ATTENTION_BACKWARD[fwd.target] and u.args[2] is key and u.args[3] is value]
    if len(bwds) != 1 or set(key.users) - {fwd, bwds[0]} or set(value.users) - {fwd, bwds[0]}:
        raise NotMatched("the gathered K/V have users besides the attention and its backward")
    bwd = bwds[0]
    outs = {u.args[1]: u for u in bwd.users if u.target is operator.getitem}
    if set(outs) - {0, 1, 2} or 0 not in outs:
        raise NotMatched(f"{bwd.name}'s outputs are used unexpectedly")
    grads, befores = {}, {}
    for i, name in ((1, "k"), (2, "v")):
        gather = region.collectives[i - 1]
        grads[name] = _drain(outs[i], gather) if i in outs else None
        befores[name] = _local_shapes(region, name)
    return {"bwd": bwd, "dq": outs[0], "grads": grads, "befores": befores}


def _match_flex(region: AttentionRegion) -> dict:
    """_match for flex_attention: its flex_attention_backward (on the same gathered K/V, its out
    and LSE from this forward, no LSE gradient), the dq getitem and each K/V gradient's wait."""
    fwd = region.attention
    if region.flex.dense:  # SDPA with a boolean mask: SDPA's own backward (no mask gradient)
        if fwd.target not in ATTENTION_BACKWARD:
            raise NotMatched(f"{fwd.target} has no backward here")
        plan = _match(region)
        return dict(plan, dout=plan["bwd"].args[0])
    key, value = fwd.args[1], fwd.args[2]
    bwds = [u for u in key.users if u.target is FLEX_BACKWARD and u.args[1] is key and u.args[2] is value]
    if len(bwds) != 1 or set(key.users) - {fwd, bwds[0]} or set(value.users) - {fwd, bwds[0]}:
        raise NotMatched("the gathered K/V have users besides flex_attention and its backward")
    bwd = bwds[0]
    if bwd.args[6] is not None:
        raise NotMatched("a gradient flows into the log-sum-exp")
    outs = {u.args[1]: u for u in bwd.users if u.target is operator.getitem}
    if set(outs) - {0, 1, 2, 3} or 0 not in outs or (3 in outs and outs[3].users):
        raise NotMatched(f"{bwd.name}'s outputs are used unexpectedly (its score/mask buffers' gradients?)")
    grads, befores = {}, {}
    for i, name in ((1, "k"), (2, "v")):
        grads[name] = _drain(outs[i], region.collectives[i - 1]) if i in outs else None
        befores[name] = _local_shapes(region, name)
    return {"bwd": bwd, "dq": outs[0], "grads": grads, "befores": befores, "dout": bwd.args[5]}


def _apply_flex(graph: Graph, region: AttentionRegion, plan: dict, schedule: str, keep: bool = False) -> None:
    """The flex forward and backward as cp_flex_attention_fwd / _bwd on the rank's own K/V (its out
    and LSE, natural log, carried from one to the other); the K/V gradients brought back to the
    shards' layout where the reduce-scatters delivered them; the gathers and reduce-scatters go.
    keep: the _keep / _kept pair instead, the forward's gathered K/V carried to the backward (the
    partitioner saves them, as it saved the program's own gathered K/V)."""
    fwd, bwd = region.attention, plan["bwd"]
    ops = (torch.ops.commopt.cp_flex_attention_fwd_keep, torch.ops.commopt.cp_flex_attention_bwd_kept) if keep \
        else (torch.ops.commopt.cp_flex_attention_fwd, torch.ops.commopt.cp_flex_attention_bwd)
    with graph.inserting_before(fwd):
        common = flex_arguments(graph, region, schedule)
        k, v = _local(graph, region, "k"), _local(graph, region, "v")
        pair = add_node(graph, ops[0].default, (region.inputs["q"], k, v, *common))
        out, lse, *kept = (add_node(graph, operator.getitem, (pair, i)) for i in range(4 if keep else 2))
    region.output.replace_all_uses_with(out)
    with graph.inserting_before(bwd):
        grads = add_node(graph, ops[1].default, (plan["dout"], region.inputs["q"], *(kept or (k, v)), out, lse, *common))
        parts = [add_node(graph, operator.getitem, (grads, i)) for i in range(3)]
    _replace_gradients(graph, region, plan, parts, list(fwd.users))  # the old outputs' detaches go too


def _replace_gradients(graph: Graph, region: AttentionRegion, plan: dict, parts: list[Node],
                       also: list[Node] = ()) -> None:
    """dq and the K/V gradients (brought back to the shards' layout where the reduce-scatters
    delivered them) replaced by the op's `parts`; then the gathers, the gradients' reduce-scatters,
    `also` and what they fed, up to the replaced nodes, erased where unused."""
    fwd, bwd = region.attention, plan["bwd"]
    plan["dq"].replace_all_uses_with(parts[0])
    for i, name in ((1, "k"), (2, "v")):
        wait = plan["grads"][name]
        if wait is not None:
            with graph.inserting_before(wait):
                wait.replace_all_uses_with(_to_shard_layout(graph, region, name, parts[i], plan["befores"][name]))
    stops = {fwd, bwd} | {w for w in plan["grads"].values() if w is not None}
    chain, todo = set(), list(region.collectives) + [u for u in bwd.users if u.args[1] in (1, 2)] + list(also)
    while todo:
        node = todo.pop()
        if node not in chain:
            chain.add(node)
            todo += [u for u in node.users if u not in stops]
    chain |= stops | set(fwd.users) | set(bwd.users)
    for node in reversed(list(graph.nodes)):
        if node in chain and not node.users:
            graph.erase_node(node)


def _drain(dgrad: Node, gather: Node) -> Node:
    """The wait of the reduce-scatter that `dgrad` (the gathered tensor's gradient) drains
    into through the gather's relayout, checked against the gather (group, shape)."""
    seen, todo, waits = set(), [dgrad], []
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.target is REDUCE_SCATTER:
                waits += [w for w in user.users if w.target is WAIT]
                seen.add(user)
            elif user.target in DRAIN and user not in seen:
                seen.add(user)
                todo.append(user)
            elif user not in seen:
                raise NotMatched(f"{dgrad.name} reaches {user.name} ({user.target}) outside its reduce-scatter")
    if len(waits) != 1:
        raise NotMatched(f"{dgrad.name} drains into {len(waits)} reduce-scatters")
    rs = waits[0].args[0]
    if group_name_of(rs.args[3]) != group_name_of(gather.args[2]) or rs.args[1] != "sum":
        raise NotMatched(f"{rs.name} is not the sum over the gather's group")
    if static_shape(waits[0]) != static_shape(gather.args[0]):
        raise NotMatched(f"{rs.name} does not deliver the gathered shard's shape")
    return waits[0]


def _apply(graph: Graph, region: AttentionRegion, plan: dict, schedule: str) -> None:
    fwd, bwd = region.attention, plan["bwd"]
    common = (schedule, region.causal, region.scale, region.world, region.group_name)
    with graph.inserting_before(fwd):
        k, v = _local(graph, region, "k"), _local(graph, region, "v")
        out, saved = insert_training_forward(graph, region.inputs["q"], k, v, common)
    region.output.replace_all_uses_with(out)
    with graph.inserting_before(bwd):
        grads = insert_training_backward(graph, bwd.args[0], saved, common)
        parts = [add_node(graph, operator.getitem, (grads, i)) for i in range(3)]
    _replace_gradients(graph, region, plan, parts)


def _to_shard_layout(graph: Graph, region: AttentionRegion, name: str, grad: Node, befores: list) -> Node:
    """The gradient of the attention's local K (or V) brought back to the gathered shard's
    layout: the relayout `_local` applied, undone op by op."""
    for op, before in zip(reversed(region.paths[name]), reversed(befores)):
        grad = _inverse(graph, op, grad, before)
    return grad


def _local_shapes(region: AttentionRegion, name: str) -> list[list[int]]:
    """The shard's shape before each op of the forward relayout; NotMatched where an op
    cannot be undone on the gradient or the cut dim cannot be followed."""
    shape = static_shape(region.collectives[0 if name == "k" else 1].args[0])
    out = []
    for op in region.paths[name]:
        if op.target not in INVERTIBLE:
            raise NotMatched(f"{op.name} ({op.target}) in the K/V relayout has no inverse here")
        out.append(list(shape))
        full_in, full_out = static_shape(op.args[0]), static_shape(op)
        if op.target is aten.transpose.int:
            shape = list(torch.empty(shape, device="meta").transpose(op.args[1], op.args[2]).shape)
        elif op.target is aten.permute.default:
            shape = list(torch.empty(shape, device="meta").permute(op.args[1]).shape)
        elif op.target in RESHAPE_OPS:
            cut = [d for d, (a, b) in enumerate(zip(shape, full_in)) if a != b]
            pos = _reshaped_dim(full_in, full_out, cut[0]) if len(cut) == 1 else None
            if pos is None:
                raise NotMatched(f"{op.name}: the sequence dim does not survive the reshape")
            shape = list(full_out)
            shape[pos] //= region.world
    return out


def _inverse(graph: Graph, op: Node, grad: Node, shape_before: list[int]) -> Node:
    t = op.target
    if t is aten.transpose.int:
        return add_node(graph, t, (grad, op.args[1], op.args[2]))
    if t is aten.permute.default:
        dims = [d % len(shape_before) for d in op.args[1]]
        return add_node(graph, t, (grad, [dims.index(i) for i in range(len(dims))]))
    if t in RESHAPE_OPS:
        dense = add_node(graph, aten.clone.default, (grad,), {"memory_format": torch.contiguous_format})
        return add_node(graph, aten.view.default, (dense, shape_before))
    return grad  # clone / alias
