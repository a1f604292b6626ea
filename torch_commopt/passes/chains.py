"""Row-preserving view chains between a collective and a matmul, and their replay.

A matmul works row by row: any chain of views, permutes, slices or clones that keeps
the contracted (last) dim last and intact only moves whole rows.  Such a chain can be
replayed on the matmul's *output* (last dim K -> N) or *input* (N -> K), which is how
regions reach through the reshapes DTensor and `nn.Linear` put around `mm`.
"""

from __future__ import annotations

from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import RESHAPES, Unsupported, aten, norm_dim, row_shape, same_shape, val

LINEAR_CHAIN_OPS = RESHAPES | {
    aten.permute.default,
    aten.transpose.int,
    aten.clone.default,
    aten.alias.default,
    aten.slice.Tensor,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
}
# Ops whose second argument is a shape that ends with the last dim.
SHAPE_ARG_OPS = RESHAPES | {aten.expand.default}


def keeps_last_dim(node: Node) -> bool:
    """True when `node` is a single-input op that keeps the last dim of its input last and intact."""
    if node.op != "call_function" or node.target not in LINEAR_CHAIN_OPS:
        return False
    if val(node) is None or val(node.args[0]) is None:
        return False
    try:  # rows may be symbolic (dynamic shapes); the last dim never is
        in_shape, out_shape = row_shape(node.args[0]), row_shape(node)
    except Unsupported:
        return False
    nd, t = len(in_shape), node.target
    if nd == 0 or not out_shape or in_shape[-1] != out_shape[-1]:
        return False
    if t is aten.permute.default:
        return norm_dim(node.args[1][-1], nd) == nd - 1
    if t is aten.transpose.int:
        return nd - 1 not in (norm_dim(node.args[1], nd), norm_dim(node.args[2], nd))
    if t is aten.slice.Tensor:
        return norm_dim(node.args[1] if len(node.args) > 1 else 0, nd) != nd - 1
    if t is aten.unsqueeze.default:
        return norm_dim(node.args[1], nd + 1) != nd
    if t is aten.squeeze.dim:
        return norm_dim(node.args[1], nd) != nd - 1
    if t is aten.expand.default:
        # only the no-op expand matmul decompositions insert
        return same_shape(in_shape, out_shape)
    # Reshapes: in row-major order, equal last sizes keep every K-run together.
    return True


def _replayed_args(node: Node, new_input: Node, last_from: int, last_to: int) -> tuple:
    args = list(node.args)
    args[0] = new_input
    if node.target in SHAPE_ARG_OPS:
        shape = list(args[1])
        if shape and shape[-1] == last_from:
            shape[-1] = last_to
        args[1] = shape
    return tuple(args)


def replay_chain(graph: Graph, start: Node, path: list[Node], last_from: int, last_to: int) -> Node:
    """Apply the ops of `path` to `start` with the last dim `last_from` replaced by `last_to`.

    Inserts at the graph's current insertion point; returns the last new node (or `start`)."""
    current = start
    for node in path:
        new = graph.call_function(node.target, _replayed_args(node, current, last_from, last_to), dict(node.kwargs))
        set_fake_val(new)
        current = new
    return current


def add_node(graph: Graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    """graph.call_function at the current insert point, with its fake value recorded."""
    node = graph.call_function(target, args, kwargs or {})
    set_fake_val(node)
    return node


def set_fake_val(node: Node) -> None:
    """Record node.meta['val'] by running the node's target on the inputs' fake values."""

    def to_val(a):
        if isinstance(a, Node):
            return a.meta.get("val")
        if isinstance(a, (list, tuple)):
            return type(a)(to_val(x) for x in a)
        return a

    args, kwargs = to_val(node.args), {k: to_val(v) for k, v in node.kwargs.items()}
    flat = [v for v in list(args) + list(kwargs.values()) if v is not None]
    flat += [x for v in flat if isinstance(v, (list, tuple)) for x in v]
    mode = detect_fake_mode(flat) or FakeTensorMode()
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)
