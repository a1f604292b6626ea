"""Find all-gather -> matmul regions (`ag_matmul`).

Forms recognised in post-grad graphs:
  all_gather_into_tensor -> wait_tensor                          (gather dim 0)
  ... -> split(L, dim 0) -> W getitems -> cat(dim g)              (gather dim g > 0, the
                                                                   funcol / DTensor form)
then, from the gathered tensor, row-preserving chains (view, reshape, permute, ...) into
the A operand of mm / addmm / _scaled_mm (float8, passes/matmul/scaled_mm.py; a float8 shard
gathered as uint8 and viewed back counts), or straight into bmm.  Several matmuls of one all-gather
(q/k/v, w1/w3) form one region; any other use of the gathered tensor keeps it alive
(the op then returns it as well).
"""

from __future__ import annotations

from torch.fx import Graph, Node

from torch_commopt.passes.chains import keeps_last_dim
from torch_commopt.passes.graph_utils import (
    ADDMM,
    ALL_GATHER,
    BMM,
    MM,
    SCALED_MM,
    Unsupported,
    aten,
    cat_dim,
    group_name_of,
    row_shape,
    split_cat_dim,
    static_shape,
    wait_of,
)
from torch_commopt.passes.matmul.scaled_mm import check_consumers, float8_view, scaled_operands
from torch_commopt.passes.regions import Consumer, Region
from torch_commopt.report import Skip
from torch_commopt.reshard.layouts import Replicate, Shard


def find_ag_matmul(graph: Graph) -> tuple[list[Region], list[Skip]]:
    regions, skips = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is ALL_GATHER:
            try:
                regions.append(_region_of(node))
            except Unsupported as e:
                skips.append(Skip("ag_matmul", node.name, str(e)))
    return regions, skips


def _region_of(ag: Node) -> Region:
    group_name, world = group_name_of(ag.args[2]), ag.args[1]
    wait = wait_of(ag)
    a_shape = row_shape(ag.args[0])
    if len(a_shape) < 2:
        raise Unsupported(f"gathered tensor is {len(a_shape)}-D; a matmul needs rows")
    root, gather_dim, nodes, a_view = wait, 0, [ag, wait], None
    if (view := float8_view(root)) is not None:  # float8 bytes gathered as uint8
        root, a_view = view
        nodes.append(root)
    users = list(root.users)
    if len(users) == 1 and (form := split_cat_dim(users[0], world)) is not None and form[0] == 0:
        root, gather_dim = form[1], cat_dim(form[1])
        nodes += [users[0], *users[0].users, root]
        if a_view is None and (view := float8_view(root)) is not None:
            root, a_view = view
            nodes.append(root)
    descendants = _descendants(ag)
    consumers, other_use = _collect(root, [], descendants)
    if not consumers:
        raise Unsupported(
            "no mm/addmm/bmm/_scaled_mm takes the gathered tensor as its A operand "
            "(through views/permutes that keep the contracted dim last)"
        )
    check_consumers(consumers)
    return Region(
        kind="ag_matmul", collective=ag, wait=wait, group_name=group_name, group_size=world,
        dim=gather_dim, a=ag.args[0], consumers=consumers, root=root, keep_gathered=other_use,
        nodes=nodes, in_layout=Shard(gather_dim), out_layout=Replicate(), a_view=a_view,
    )


def _collect(node: Node, path: list[Node], forbidden: set[Node]) -> tuple[list[Consumer], bool]:
    """Consumers reachable from `node` through row-preserving chains; True if any other use."""
    consumers, other_use = [], False
    for user in node.users:
        consumer = _as_consumer(user, node, path, forbidden)
        if consumer is not None:
            consumers.append(consumer)
        elif keeps_last_dim(user):
            found, other = _collect(user, path + [user], forbidden)
            consumers += found
            other_use |= other
        else:
            other_use = True
    return consumers, other_use


def _as_consumer(user: Node, operand: Node, path: list[Node], forbidden: set[Node]) -> Consumer | None:
    """`user` as a matmul taking `operand` as A, with a weight/bias independent of the gather."""
    if user.op != "call_function":
        return None
    scaled = None
    if user.target is MM and user.args[0] is operand and user.args[1] is not operand:
        weight, bias = user.args[1], None
    elif user.target is SCALED_MM and user.args[0] is operand:
        _, weight, bias, scaled = scaled_operands(user)
        if scaled.a_scale in forbidden or scaled.b_scale in forbidden:
            raise Unsupported(f"_scaled_mm {user.name} has a scale computed from the gathered tensor")
    elif user.target is ADDMM and user.args[1] is operand and not user.kwargs:
        weight, bias = user.args[2], user.args[0]
        n = static_shape(weight)[-1]
        if static_shape(bias) != [n]:
            return None
    elif user.target is BMM and user.args[0] is operand:
        weight, bias = user.args[1], None
        if weight.op == "call_function" and weight.target is aten.expand.default and len(static_shape(weight.args[0])) == 2:
            weight = weight.args[0]  # a 2-D weight broadcast over the batch: a row-wise matmul
        elif path:
            return None  # a batched weight pairs with the batch dim: no chain may move rows
    else:
        return None
    if weight in forbidden or bias in forbidden:
        return None
    return Consumer(node=user, path=list(path), weight=weight, bias=bias, scaled=scaled)


def _descendants(node: Node) -> set[Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen
