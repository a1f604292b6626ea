"""Hand-built post-grad graphs for the finder tests: placeholders and calls carrying meta values
of given shapes (what the passes read), no tracing."""

from __future__ import annotations

import torch
from torch.fx import Graph


def builder(*placeholder_shapes, names=None):
    """(graph, node, *placeholders): a graph whose placeholders hold meta values of the given
    shapes, and node(target, args, shape) adding a call with a meta value of that shape."""
    g = Graph()

    def node(target, args, shape):
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(shape, device="meta")
        return n
    placeholders = []
    for i, shape in enumerate(placeholder_shapes):
        p = g.placeholder(names[i] if names else f"p{i}")
        p.meta["val"] = torch.empty(shape, device="meta")
        placeholders.append(p)
    return (g, node, *placeholders)


def gather_split_cat(g, node, x, world: int, group: str, cat_dim: int):
    """The funcol / DTensor form of an all-gather along a dim: wait(all_gather(x)) split into its
    `world` row blocks, concatenated along cat_dim.  Returns (the wait, the cat)."""
    import operator

    from torch_commopt.passes.graph_utils import ALL_GATHER, WAIT, aten

    shape = tuple(x.meta["val"].shape)
    gathered = (world * shape[0], shape[1])
    wait = node(WAIT, (node(ALL_GATHER, (x, world, group), gathered),), gathered)
    split = g.call_function(aten.split.Tensor, (wait, shape[0]))
    pieces = []
    for i in range(world):
        piece = g.call_function(operator.getitem, (split, i))
        piece.meta["val"] = torch.empty(shape, device="meta")
        pieces.append(piece)
    cat_shape = (shape[0], world * shape[1]) if cat_dim == 1 else gathered
    return wait, node(aten.cat.default, (pieces, cat_dim), cat_shape)
