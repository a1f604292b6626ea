"""Fixed-capacity MoE in compiled graphs: the dispatch all-to-all, the experts, the combine
all-to-all, run in chunks of local experts so that the exchanges overlap the experts' GEMMs.

A dropless MoE never reaches the compiler whole (its split sizes are data: docs/moe.md), but a
fixed-capacity one does: its two `all_to_all_single` exchanges have equal splits, and between
them the local experts run as batched GEMMs.  `find` reads each such pair (layout.py says what
may lie between them); `rewrite` replaces it with C chunks of experts, by_expert's schedule
written in the graph's own functional collectives:

    every chunk's dispatch issued where the dispatch was (its rows cut out of the send buffer)
    for each chunk: wait for its rows, run the experts' ops on them, issue its combine
    wait for every combine, the outputs put back together

so chunk c's experts run while chunk c + 1's tokens travel, and chunk c's outputs travel while
chunk c + 1's experts run.  Tensors of the region that the rest of the graph reads (a training
forward saves them for the backward) are put back together from their chunks too.  The same
reading takes the backward graph, whose two exchanges carry the gradients the other way: each
chunk's weight gradients are batched GEMMs over that chunk's experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import (
    ALL_TO_ALL,
    BMM,
    RESHAPES,
    WAIT,
    Unsupported,
    aten,
    descendants,
    equal_parts,
    only_user,
    static_shape,
)
from torch_commopt.passes.moe.layout import Analysis, Slice, analyse, region_between
from torch_commopt.report import Skip


@dataclass
class CapacityRegion:
    dispatch: Node  # the first all_to_all_single
    combine: Node  # the second
    region: list[Node]  # the first's wait, then every node between, in graph order
    world: int
    group_name: str
    found: Analysis

    @property
    def wait(self) -> Node:
        return self.region[0]

    @property
    def local_experts(self) -> int:
        return self.found.atoms.size[self.found.expert]

    def read_outside(self) -> list[Node]:
        """The region's tensors the rest of the graph reads (each chunk's are joined for it)."""
        inside = set(self.region) | {self.combine}
        return [n for n in self.region if any(u not in inside for u in n.users)]

    def gemms(self) -> list[tuple[int, int, int]]:
        """(rows, out cols, contracted) of each batched GEMM in the region, batches folded into rows."""
        out = []
        for n in self.region:
            if n.target is BMM:
                (b, m, k), (_, _, cols) = static_shape(n.args[0]), static_shape(n.args[1])
                out.append((b * m, cols, k))
        return out

    def summary(self) -> str:
        rows = static_shape(self.dispatch.args[0])
        return (f"{self.world} ranks, {rows[0]} rows x {math.prod(rows[1:])}, {self.local_experts} local experts, "
                f"{len(self.region)} ops between the exchanges")


def _wait(a2a: Node) -> Node | None:
    user = only_user(a2a)
    return user if user is not None and user.target is WAIT else None


def find(graph: Graph) -> tuple[list[CapacityRegion], list[Skip]]:
    """Every dispatch / experts / combine triple the chunks can run; the others with why not."""
    found, skipped, claimed = [], [], set()
    for node in graph.nodes:
        if node.target is not ALL_TO_ALL or node in claimed:
            continue
        world, wait = equal_parts(node), _wait(node)
        if world is None or world < 2 or wait is None:
            continue
        combine = _next_exchange(wait, node.args[3], world)
        if combine is None or _wait(combine) is None:
            continue
        try:
            region = region_between(wait, combine)
            found.append(CapacityRegion(node, combine, region, world, node.args[3], analyse(wait, region, world)))
            claimed |= {node, combine}
        except Unsupported as e:
            skipped.append(Skip("moe", node.name, f"not a fixed-capacity MoE the chunks can run: {e}"))
    return found, skipped


def _next_exchange(wait: Node, group_name, world: int) -> Node | None:
    """The first all_to_all_single (in graph order) downstream of `wait` on the same group with
    equal splits over the same ranks."""
    down = descendants(wait)
    return next((n for n in wait.graph.nodes if n in down and n.target is ALL_TO_ALL and n.args[3] == group_name
                 and equal_parts(n) == world), None)


def rewrite(graph: Graph, r: CapacityRegion, bounds: list[tuple[int, int]]) -> None:
    """`r` in chunks of local experts [lo, hi) (module docstring)."""
    f = r.found
    sent = []
    with graph.inserting_before(r.dispatch):
        for lo, hi in bounds:
            rows = _slice_dim(graph, f, r.dispatch.args[0], 0, f.dims(r.wait)[0], (lo, hi))
            sent.append(_exchange(graph, rows, r))
    inside = set(r.region) | {r.combine}
    outside = {n: [u for u in n.users if u not in inside] for n in r.read_outside()}
    kept = {n: [] for n in outside}
    slices: dict[Node, list[Slice]] = {}
    for s in f.slices:
        slices.setdefault(s.node, []).append(s)
    with graph.inserting_before(r.combine):
        back = []
        for (lo, hi), a2a in zip(bounds, sent):
            env = {r.wait: add_node(graph, WAIT, (a2a,))}
            for n in r.region[1:]:
                env[n] = _replay(graph, f, n, env, slices.get(n, ()), (lo, hi))
            back.append(_exchange(graph, env[r.combine.args[0]], r))
            for n, chunks in kept.items():
                chunks.append(env[n])
        arrived = [add_node(graph, WAIT, (a2a,)) for a2a in back]
        whole = _join(graph, f, r.combine.args[0], arrived)
        joined = {n: _join(graph, f, n, chunks) for n, chunks in kept.items()}
    combined = _wait(r.combine)
    combined.replace_all_uses_with(whole)
    for n, users in outside.items():
        for u in users:
            u.replace_input_with(n, joined[n])
    for n in [combined, r.combine] + r.region[::-1] + [r.dispatch]:
        graph.erase_node(n)


def _exchange(graph: Graph, rows: Node, r: CapacityRegion) -> Node:
    n = static_shape(rows)[0] // r.world
    return add_node(graph, ALL_TO_ALL, (rows, [n] * r.world, [n] * r.world, r.group_name))


def _split_shape(shape: list[int], dim: int, sizes: list[int]) -> list[int]:
    return shape[:dim] + sizes + shape[dim + 1:]


def _slice_dim(graph: Graph, f: Analysis, x: Node, dim: int, atoms: list[int], span: tuple[int, int]) -> Node:
    """x with its dim `dim` (made of `atoms`) cut to the experts in span: viewed with that dim
    split into its atoms, sliced on the experts' one, and viewed back (a copy where the slice is
    not outermost).  The dispatch's send buffer is cut this way, by the layout its rows arrive in
    (every rank lays out its send blocks as the receivers read them: SPMD)."""
    shape = static_shape(x)
    sizes = [f.atoms.size[a] for a in atoms]
    at = dim + atoms.index(f.expert)
    view = add_node(graph, aten.reshape.default, (x, _split_shape(shape, dim, sizes)))
    part = add_node(graph, aten.slice.Tensor, (view, at, span[0], span[1]))
    lo, hi = span
    out = list(shape)
    out[dim] = shape[dim] // f.atoms.size[f.expert] * (hi - lo)
    if at != dim:
        part = add_node(graph, aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
    return add_node(graph, aten.reshape.default, (part, out))


def _replay(graph: Graph, f: Analysis, n: Node, env: dict, slices, span: tuple[int, int]) -> Node:
    """Region node `n` over the chunk's experts."""
    args = [env.get(a, a) if isinstance(a, Node) else a for a in n.args]
    for s in slices:
        args[s.arg] = _slice_dim(graph, f, n.args[s.arg], s.dim, f.atoms.dims([s.atoms])[0], span)
    if n.target in RESHAPES:
        dims, per = f.dims(n), f.atoms.size[f.expert]
        shape = static_shape(n)
        args[1] = [s // per * (span[1] - span[0]) if f.expert in dims[j] else s for j, s in enumerate(shape)]
    return add_node(graph, n.target, tuple(args), dict(n.kwargs))


def _join(graph: Graph, f: Analysis, n: Node, chunks: list[Node]) -> Node:
    """`n` whole from its chunks: each viewed with its experts' dim split into atoms, concatenated
    on the experts' atom, viewed back as n."""
    dims, shape = f.dims(n), static_shape(n)
    j = f.expert_dim(n)
    at = j + dims[j].index(f.expert)
    parts = []
    for c in chunks:
        cshape = static_shape(c)
        sizes = [f.atoms.size[a] if a != f.expert else -1 for a in dims[j]]
        parts.append(add_node(graph, aten.reshape.default, (c, _split_shape(cshape, j, sizes))))
    cat = add_node(graph, aten.cat.default, (parts, at))
    return add_node(graph, aten.reshape.default, (cat, shape))
