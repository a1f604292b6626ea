"""Small helpers over post-grad aten FX graphs: op tables, shapes, collective arguments."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
ALL_TO_ALL = c10d.all_to_all_single.default
WAIT = c10d.wait_tensor.default

MM = aten.mm.default
ADDMM = aten.addmm.default
BMM = aten.bmm.default
SCALED_MM = aten._scaled_mm.default
VIEW_DTYPE = aten.view.dtype

RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


class Unsupported(Exception):
    """A pattern that commopt leaves untouched; the message is the reason shown in explain."""


def val(node: Any) -> torch.Tensor | None:
    """The fake tensor recorded for `node` (None for non-nodes or nodes without one)."""
    if isinstance(node, Node):
        v = node.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


DYNAMIC_SHAPE = "has a dynamic shape"  # in the reason of every region a symbolic size stops


def _shape(node: Node) -> list:
    v = val(node)
    if v is None:
        raise Unsupported(f"{node.name} has no recorded shape")
    return list(v.shape)


def static_shape(node: Node) -> list[int]:
    """The node's shape as Python ints; raises Unsupported for a dynamic (symbolic) shape."""
    shape = _shape(node)
    if not is_static(shape):
        raise Unsupported(f"{node.name} {DYNAMIC_SHAPE} {shape}")
    return shape


def row_shape(node: Node) -> list:
    """The node's shape with symbolic (dynamic) sizes allowed in every dim but the last, which
    a matmul contracts or produces and so must be a Python int; raises Unsupported otherwise.
    What the matmul-collective finders take: their ops handle any row count."""
    shape = _shape(node)
    if shape and not isinstance(shape[-1], int):
        raise Unsupported(f"{node.name} {DYNAMIC_SHAPE} {shape} in its last dim")
    return shape


def is_static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def same_size(a, b) -> bool:
    """a == b for sizes that may be symbolic: True only when it holds for every value of the
    symbols (never a guard: a post-grad pass must not specialize the graph)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def same_shape(a, b) -> bool:
    """Two shapes equal for every value of their symbols."""
    return len(a) == len(b) and all(map(same_size, a, b))


def divides(n, world: int) -> bool:
    """Whether `world` divides the size `n` (symbolic: for every value of its symbols)."""
    return n % world == 0 if isinstance(n, int) else same_size(n % world, 0)


def size_hint(n) -> int:
    """A size as an int: itself, or the example value a symbolic size was traced with (what
    costs and reports of dynamic regions are computed for)."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    if hint is None:
        raise Unsupported(f"size {n} has no example value (unbacked)")
    return int(hint)


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def group_name_of(arg: Any) -> str:
    """The group name of a functional collective's group argument (a str; from 2.13 `Any`)."""
    if isinstance(arg, str):
        return arg
    name = getattr(arg, "group_name", None)
    if isinstance(name, str):
        return name
    raise Unsupported(f"cannot identify the process group from {arg!r}")


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def wait_of(collective: Node) -> Node:
    """The wait_tensor that is the collective's only user."""
    user = only_user(collective)
    if user is None or user.target is not WAIT:
        raise Unsupported(f"{collective.name} is not waited on by exactly one wait_tensor")
    return user


def equal_parts(a2a: Node) -> int | None:
    """The group size of an all_to_all_single with equal (or default) splits, else None."""
    outs, ins = a2a.args[1], a2a.args[2]
    if not isinstance(outs, (list, tuple)) or not outs or len(set(outs) | set(ins)) != 1:
        return None
    return len(outs)


def descendants(node: Node, stop: Node | None = None) -> set[Node]:
    """Every node downstream of `node` (not through `stop`)."""
    down, stack = set(), [node]
    while stack:
        for u in stack.pop().users:
            if u not in down and u is not stop:
                down.add(u)
                stack.append(u)
    return down


def is_getitem(node: Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def split_cat_dim(split: Node, world: int) -> tuple[int, Node] | None:
    """For split(x, L, dim=d) -> W getitems -> cat(dim=e): the (d, e) form funcol and DTensor emit
    to gather or scatter along a dim other than 0.  Returns (split dim, cat node) or None."""
    if split.target not in SPLITS:
        return None
    x_shape = row_shape(split.args[0])
    sdim = norm_dim(split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0), len(x_shape))
    sizes = split.args[1]
    if isinstance(sizes, (list, tuple)):
        n_pieces = len(sizes)
    else:  # one piece size: an int, or with dynamic shapes a symbolic one (a node's value)
        size = sizes.meta.get("val") if isinstance(sizes, Node) else sizes
        if isinstance(size, int) and isinstance(x_shape[sdim], int):
            n_pieces = -(-x_shape[sdim] // size)
        else:  # symbolic: taken only as exactly `world` pieces
            n_pieces = world if size is not None and same_size(size * world, x_shape[sdim]) else None
    getitems = sorted(split.users, key=lambda n: n.args[1] if is_getitem(n) else -1)
    if n_pieces != world or len(getitems) != world or not all(is_getitem(g) for g in getitems):
        return None
    if [g.args[1] for g in getitems] != list(range(world)):
        return None
    cats = {only_user(g) for g in getitems}
    if len(cats) != 1 or None in cats:
        return None
    (cat,) = cats
    if cat.target is not aten.cat.default or list(cat.args[0]) != getitems:
        return None
    return sdim, cat


def cat_dim(cat: Node) -> int:
    ndim = len(row_shape(cat))
    return norm_dim(cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0), ndim)
