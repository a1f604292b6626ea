"""2D GEMMs: a matmul whose two operands are each all-gathered over one axis of a 2D mesh
(`gemm_2d`, MeshSlice's output-stationary dataflow).

DTensor multiplies X [M, K] and W [K, N], each sharded over both dims of an R x C mesh
(`[Shard(0), Shard(1)]`: rank (i, j) holds block (i, j)), by gathering X's K blocks along the mesh's
dim 1 (the C ranks of its row) and W's K blocks along dim 0 (the R ranks of its column), then
one local mm: the Collective 2D GEMM.  In the post-grad graph:

    all_gather(X, C, cols) -> wait -> split(M/R, dim 0) -> C getitems -> cat(dim 1)  = A
    all_gather(W, R, rows) -> wait                                                  = B
    mm(A, B)

Both gathers feed only the mm.  The region becomes `commopt.gemm_2d(X, W, "os", S, R, C, rows, cols)`:
MeshSlice's sliced GEMM, slice s + 1's two partial gathers in flight while slice s multiplies.  The
slice count S is the cost model's (tuner/mesh2d) for the global shape on this mesh, or
`Config.mesh2d_slices`.  Anything else -- one of the gathers used elsewhere, a 1-D mesh, a
dynamic shape -- is left to the 1-D finders (ag_matmul takes X's gather)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import (
    ALL_GATHER,
    MM,
    WAIT,
    Unsupported,
    aten,
    cat_dim,
    group_name_of,
    is_static,
    split_cat_dim,
    static_shape,
)
from torch_commopt.report import Skip
from torch_commopt.tuner.mesh2d.model import meshslice_s
from torch_commopt.tuner.mesh2d.simulate import GPUCluster

MAX_SLICES = 16
CAT = aten.cat.default


@dataclass
class Region2D:
    """One 2D GEMM found in a graph: mm = A @ B with A gathered over `cols_group` (C ranks, along
    K = dim 1) and B over `rows_group` (R ranks, along K = dim 0)."""

    mm: Node
    x: Node  # X's block [M/R, K/C]
    w: Node  # W's block [K/R, N/C]
    rows_group: str
    cols_group: str
    rows: int
    cols: int
    nodes: list[Node] = field(default_factory=list)  # the gathers' nodes, erased by the rewrite
    kind: str = "gemm_2d"

    @property
    def global_mnk(self) -> tuple[int, int, int]:
        (m, k), (_, n) = static_shape(self.x), static_shape(self.w)
        return m * self.rows, n * self.cols, k * self.cols

    def summary(self) -> dict:
        x = self.x.meta["val"]
        return {"kind": self.kind, "dataflow": "os", "mesh": [self.rows, self.cols],
                "groups": {"rows": self.rows_group, "cols": self.cols_group},
                "x_shape": list(static_shape(self.x)), "w_shape": list(static_shape(self.w)),
                "dtype": str(x.dtype).removeprefix("torch."), "matmul": self.mm.name}


def find_gemm_2d(graph: Graph) -> tuple[list[Region2D], list[Skip]]:
    regions, skips = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is MM:
            try:
                region = _region_of(node)
            except Unsupported as e:
                if _both_gathered(node):  # a 2D candidate after all: say why not
                    skips.append(Skip("gemm_2d", node.name, str(e)))
                continue
            if region is not None:
                regions.append(region)
    return regions, skips


def _gathered(node: Node) -> tuple[Node, Node, list[Node]] | None:
    """(the all-gather, the node holding the gathered tensor, the chain's nodes) when `node` is a
    gathered tensor: wait(all_gather) itself, or cat(split(wait(all_gather))) along another dim."""
    if node.op != "call_function":
        return None
    if node.target is WAIT and node.args[0].op == "call_function" and node.args[0].target is ALL_GATHER:
        return node.args[0], node, [node.args[0], node]
    if node.target is CAT:
        getitems = list(node.args[0])
        split = getitems[0].args[0] if getitems and getitems[0].op == "call_function" else None
        wait = split.args[0] if split is not None and split.op == "call_function" and split.args else None
        if (wait is not None and wait.op == "call_function" and wait.target is WAIT
                and wait.args[0].op == "call_function" and wait.args[0].target is ALL_GATHER):
            ag = wait.args[0]
            form = split_cat_dim(split, ag.args[1])
            if form is not None and form[0] == 0 and form[1] is node:
                return ag, node, [ag, wait, split, *getitems, node]
    return None


def _both_gathered(mm: Node) -> bool:
    return _gathered(mm.args[0]) is not None and _gathered(mm.args[1]) is not None


def _region_of(mm: Node) -> Region2D | None:
    a, b = _gathered(mm.args[0]), _gathered(mm.args[1])
    if a is None or b is None:
        return None
    (ag_x, root_x, chain_x), (ag_w, root_w, chain_w) = a, b
    if root_w.target is CAT:
        raise Unsupported("W is gathered along its columns (N): not the output-stationary 2D GEMM")
    if root_x.target is not CAT or cat_dim(root_x) != 1:
        raise Unsupported("X is gathered along its rows (M): not the output-stationary 2D GEMM")
    cols_group, cols = group_name_of(ag_x.args[2]), ag_x.args[1]
    rows_group, rows = group_name_of(ag_w.args[2]), ag_w.args[1]
    if cols_group == rows_group:
        raise Unsupported("X and W are gathered over the same group: a 1-D mesh")
    for chain, root in ((chain_x, root_x), (chain_w, root_w)):
        if [u for n in chain for u in n.users if u not in chain and u is not mm] or list(root.users) != [mm]:
            raise Unsupported("a gathered operand has other uses")
    x, w = ag_x.args[0], ag_w.args[0]
    xs, ws = x.meta["val"].shape, w.meta["val"].shape
    if not (is_static(list(xs)) and is_static(list(ws))) or len(xs) != 2 or len(ws) != 2:
        raise Unsupported("X and W blocks must be static 2-D")
    if xs[1] * cols != ws[0] * rows:
        raise Unsupported(f"K does not match: X's block {list(xs)} over {cols}, W's {list(ws)} over {rows}")
    if x.meta["val"].dtype != w.meta["val"].dtype:
        raise Unsupported("X and W differ in dtype")
    return Region2D(mm=mm, x=x, w=w, rows_group=rows_group, cols_group=cols_group, rows=rows, cols=cols,
                    nodes=[*chain_x, *chain_w])


def slice_counts(region: Region2D) -> list[int]:
    """The slice counts that cut both K blocks (1: the Collective 2D GEMM), at most MAX_SLICES."""
    kx, kw = static_shape(region.x)[1], static_shape(region.w)[0]
    return [s for s in range(1, MAX_SLICES + 1) if kx % s == 0 and kw % s == 0]


def pick_slices(region: Region2D, cluster: GPUCluster | None = None) -> tuple[int, dict[int, float]]:
    """(S, seconds by S) by MeshSlice's cost model of this GEMM on its mesh (a GPU cluster's links:
    NVLink inside a node); the smallest S within 1% of the fastest (fewer, larger pieces)."""
    m, n, k = region.global_mnk
    links = (cluster or GPUCluster()).links((region.rows, region.cols))
    times = {s: meshslice_s("os", m, n, k, (region.rows, region.cols), s, links) for s in slice_counts(region)}
    best = min(times.values())
    return min(s for s, t in times.items() if t <= best * 1.01), times


def schedule_2d(slices: int) -> str:
    """How explain names a 2D GEMM's schedule."""
    return "summa" if slices == 0 else "collective (S=1)" if slices == 1 else f"meshslice:os:S={slices}"


def rewrite_gemm_2d(graph: Graph, region: Region2D, slices: int) -> Node:
    """Replace the region's mm and both gathers by one commopt.gemm_2d node; the new node."""
    import torch_commopt.kernels.mesh2d.ops  # noqa: F401  (registers commopt.gemm_2d)

    mm = region.mm
    with graph.inserting_before(mm):
        node = graph.call_function(torch.ops.commopt.gemm_2d.default,
                                   (region.x, region.w, "os", slices, region.rows, region.cols,
                                    region.rows_group, region.cols_group))
    node.meta.update(mm.meta)
    mm.replace_all_uses_with(node)
    graph.erase_node(mm)
    for n in reversed(region.nodes):
        if not n.users:
            graph.erase_node(n)
    return node
