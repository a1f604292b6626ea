"""A Ulysses program in training: the rewrite on the joint graph (passes/attention/joint.py calls it).

The joint graph holds the forward (ulysses.py's region) and its mirror:

    dout = post(wait(all_to_all(pre(dy))))                  # dy: the gradient at the result
    dq, dk, dv = sdpa_backward(dout, q, k, v, out, lse)
    gq = wait(all_to_all(path(dq)))  ...                     # back to the sequence shards

and becomes

    out, kept = cp_attention_fwd_keep(q', k', v');  result = relayout(out)
    dq', dk', dv' = cp_attention_bwd_kept(relayout(dy), kept)
    gq = relayout(dq') ...

with every relayout from the layout algebra (ulysses.Algebra): dy is brought to the op's layout
like an operand (and must order the sequence like q), each gradient back to what its
all-to-all delivered like the output.  The partitioner then saves the kept q, k, v, out and LSE
in the layout the attention ran in (the program's own Ulysses saves the same), so the backward
moves dout alone; a schedule the cost model picks that moves nothing (a ring) gets the plain
pair, cp_attention_fwd / cp_attention_bwd on q', k', v', out, lse.  The eight all-to-alls go
(the schedule moves what it needs).  With flex_attention (form "flex_ulysses") the pair is
cp_flex_attention_fwd / _bwd on q', k', v' with the program's whole-sequence mask, in place of
flex_attention and flex_attention_backward.  A region whose backward does not have exactly this
form is left alone with the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.attention.detect import (
    ALL_TO_ALL,
    ATTENTION_BACKWARD,
    FLEX_BACKWARD,
    LAYOUT_OPS,
    AttentionRegion,
    trace_back,
)
from torch_commopt.passes.attention.layout import Relayout
from torch_commopt.passes.attention.rewrite import (
    erase_unused,
    flex_arguments,
    insert_training_backward,
    insert_training_forward,
)
from torch_commopt.passes.attention.ulysses import Algebra, emit, positions
from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import WAIT, Unsupported, only_user, static_shape


@dataclass
class JointPlan:
    bwd: Node
    dy: Node  # the gradient at the result, before its all-to-all's relayout
    dy_pre: list[Node]
    dout_collective: Node
    grad_waits: dict[str, Node]  # q/k/v -> the wait delivering that input's gradient
    grad_collectives: list[Node]
    to_op: dict[str, Relayout]  # q, k, v, dout
    output: Relayout
    grads: dict[str, Relayout]


# where the backward op takes (q, k, v), out, lse and dout: SDPA's backwards, flex_attention_backward
SDPA_ARGS = {"qkv": slice(1, 4), "out": 4, "lse": 5, "dout": 0}
FLEX_ARGS = {"qkv": slice(0, 3), "out": 3, "lse": 4, "dout": 5}


def match(region: AttentionRegion) -> JointPlan:
    """Raises Unsupported where the backward is not the mirror the rewrite replaces."""
    fwd = region.attention
    out = region.paths["out"][0].args[0] if region.paths["out"] else region.collectives[3].args[0]
    flex = region.flex is not None
    at = FLEX_ARGS if flex else SDPA_ARGS
    bwds = [u for u in out.users if u.target is (FLEX_BACKWARD if flex else ATTENTION_BACKWARD.get(fwd.target))]
    if len(bwds) != 1:
        raise Unsupported(f"{len(bwds)} attention backward ops read the output")
    bwd = bwds[0]
    lse = [u for u in fwd.users if u.target is operator.getitem and u.args[1] == 1]
    if tuple(bwd.args[at["qkv"]]) != tuple(fwd.args[:3]) or bwd.args[at["out"]] is not out or not lse \
            or bwd.args[at["lse"]] is not lse[0]:
        raise Unsupported(f"{bwd.name} does not take the forward's q, k, v, out and lse")
    if flex and bwd.args[6] is not None:
        raise Unsupported("a gradient flows into the log-sum-exp")
    for operand in fwd.args[:3]:
        if set(operand.users) - {fwd, bwd}:
            raise Unsupported(f"{operand.name} has users besides the attention and its backward")
    origin, dout_post = trace_back(bwd.args[at["dout"]])
    if origin.target is not WAIT or origin.args[0].target is not ALL_TO_ALL:
        raise Unsupported(f"{bwd.name}'s dout does not come from an all-to-all")
    dout_a2a = origin.args[0]
    dy, dy_pre = trace_back(dout_a2a.args[0])

    algebra = Algebra(region.world, positions(region))
    for i, key in enumerate("qkv"):
        algebra.operand(key, region.inputs[key], region.paths[f"{key}_pre"], region.collectives[i],
                        region.paths[f"{key}_post"])
    algebra.operand("dout", dy, dy_pre, dout_a2a, dout_post)
    algebra.same_positions("q", "dout")
    output = algebra.result("out", "q", static_shape(out)[-1], region.paths["out"], region.output)

    waits, collectives, grads = {}, [], {}
    outs = {u.args[1]: u for u in bwd.users if u.target is operator.getitem}
    if flex and 3 in outs and outs[3].users:
        raise Unsupported(f"{bwd.name}'s mask buffers' gradients are used")
    for i, key in enumerate("qkv"):
        if i not in outs:
            raise Unsupported(f"{bwd.name}: the gradient of {key} is not taken")
        path, a2a = _drain(outs[i])
        waits[key], collectives = only_user(a2a), collectives + [a2a]
        grads[key] = algebra.result(f"d{key}", key, static_shape(outs[i])[-1], path, waits[key])
    return JointPlan(bwd, dy, dy_pre, dout_a2a, waits, collectives, algebra.to_op, output, grads)


def _drain(grad: Node) -> tuple[list[Node], Node]:
    """The layout ops (each the only user of the one before) from a gradient to its all-to-all."""
    node, path = grad, []
    while True:
        user = only_user(node)
        if user is None:
            raise Unsupported(f"{grad.name} has {len(node.users)} users before its all-to-all")
        if user.target is ALL_TO_ALL:
            wait = only_user(user)
            if wait is None or wait.target is not WAIT:
                raise Unsupported(f"{user.name} is not waited on by exactly one wait_tensor")
            return path, user
        if user.op != "call_function" or user.target not in LAYOUT_OPS:
            raise Unsupported(f"{grad.name} goes through {user.target}, not an all-to-all")
        path.append(user)
        node = user


def apply(graph: Graph, region: AttentionRegion, plan: JointPlan, schedule: str) -> None:
    fwd, bwd = region.attention, plan.bwd
    common = (schedule, region.causal, region.scale, region.world, region.group_name)
    with graph.inserting_before(fwd):
        q, k, v = (emit(graph, region.inputs[key], plan.to_op[key]) for key in "qkv")
        if region.flex is not None:  # the flex pair on the rank's shares, its out and LSE carried
            common = flex_arguments(graph, region, schedule)
            pair = add_node(graph, torch.ops.commopt.cp_flex_attention_fwd.default, (q, k, v, *common))
            out, lse = (add_node(graph, operator.getitem, (pair, i)) for i in range(2))
        else:
            out, saved = insert_training_forward(graph, q, k, v, common)
        result = emit(graph, out, plan.output)
    region.output.replace_all_uses_with(result)
    with graph.inserting_before(bwd):
        dout = emit(graph, plan.dy, plan.to_op["dout"])
        if region.flex is not None:
            grads = add_node(graph, torch.ops.commopt.cp_flex_attention_bwd.default, (dout, q, k, v, out, lse, *common))
        else:
            grads = insert_training_backward(graph, dout, saved, common)
        for i, key in enumerate("qkv"):
            part = add_node(graph, operator.getitem, (grads, i))
            plan.grad_waits[key].replace_all_uses_with(emit(graph, part, plan.grads[key]))
    pre = [n for key in "qkv" for n in region.paths[f"{key}_pre"]] + plan.dy_pre
    # everything downstream of the old all-to-alls and attention ops (up to the replaced waits)
    erase_unused(graph, pre, region.collectives + [plan.dout_collective, fwd, bwd] + plan.grad_collectives)
