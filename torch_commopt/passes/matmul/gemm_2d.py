"""2D GEMMs: a matmul whose operands DTensor moves over both axes of a 2D mesh (`gemm_2d`,
MeshSlice's sliced GEMMs), in two forms.

`X @ W`, X [M, K] and W [K, N] both sharded over both dims of an R x C mesh (`[Shard(0),
Shard(1)]`: rank (i, j) holds block (i, j)): X's K blocks gathered along the mesh's dim 1 (the C
ranks of its row), W's along dim 0 (the R ranks of its column), then one local mm -- the
Collective 2D GEMM, MeshSlice's output-stationary `os`:

    all_gather(X, C, cols) -> wait -> split(M/R, dim 0) -> C getitems -> cat(dim 1)  = A
    all_gather(W, R, rows) -> wait                                                  = B
    mm(A, B)

`F.linear(X, W)`, W [N, K], both sharded the same way: X's rows gathered along dim 0, the local
product with W's block reduce-scattered along its rows over dim 1 -- MeshSlice's `rs` (Y = X^T W,
W stationary) with the mesh's axes swapped (Region2D):

    all_gather(X, R, rows) -> wait -> mm(., B) -> reduce_scatter(sum, C, cols) -> wait

Each becomes one `commopt.gemm_2d`: slice s + 1's partial collectives in flight while slice s
multiplies.  Both are the graph's own function for any inputs, whatever the groups: the slices
interleave positions, so the gathered slices meet and each reduce-scattered chunk lands where the
whole collective would put it (kernels/mesh2d/reference.py).  The slice count S is the cost
model's (tuner/mesh2d) for the global shape on this mesh, or `Config.mesh2d_slices`.  Anything else
-- a gathered A used elsewhere in `os`, one group for both, a dynamic shape -- is left to the 1-D
finders (ag_matmul takes the gather)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import (
    ALL_GATHER,
    MM,
    REDUCE_SCATTER,
    WAIT,
    Unsupported,
    aten,
    cat_dim,
    group_name_of,
    is_static,
    split_cat_dim,
    static_shape,
    wait_of,
)
from torch_commopt.passes.matmul.rewrite import erase_dead
from torch_commopt.report import Skip
from torch_commopt.tuner.mesh2d.model import meshslice_s
from torch_commopt.tuner.mesh2d.simulate import GPUCluster

MAX_SLICES = 16
CAT = aten.cat.default


@dataclass
class Region2D:
    """One 2D GEMM found in a graph, as the op takes it (kernels/mesh2d/reference.py's stored forms
    on an R x C mesh whose groups are rows_group (R ranks) and cols_group (C ranks)):
        os  mm = A @ B, A = X [M/R, K/C] gathered over cols along K, B = W [K/R, N/C] over rows
        rs  reduce_scatter(mm, cols) of mm = gather(X over rows) @ B: the op's a = X^T [K/R, M/C],
            b = B [K/R, N/C], its mesh the program's with the axes swapped
    `out` is the node whose value the op's result replaces (the mm, or the reduce-scatter's wait)."""

    mm: Node
    x: Node  # os: X's block; rs: the gathered block X [M/C, K/R] (the op takes its transpose)
    w: Node  # the B operand's block [K/R, N/C]
    rows_group: str
    cols_group: str
    rows: int
    cols: int
    nodes: list[Node] = field(default_factory=list)  # the collectives' nodes, erased by the rewrite
    dataflow: str = "os"
    out: Node | None = None
    keep_gathered: bool = False  # rs: the gathered X has other users (saved for backward): the op returns it
    kind: str = "gemm_2d"

    @property
    def global_mnk(self) -> tuple[int, int, int]:
        (xr, xc), (_, n) = static_shape(self.x), static_shape(self.w)
        if self.dataflow == "rs":  # a = X^T [K/R, M/C]: xr = M/C, xc = K/R
            return xr * self.cols, n * self.cols, xc * self.rows
        return xr * self.rows, n * self.cols, xc * self.cols

    def summary(self) -> dict:
        x = self.x.meta["val"]
        return {"kind": self.kind, "dataflow": self.dataflow, "mesh": [self.rows, self.cols],
                "groups": {"rows": self.rows_group, "cols": self.cols_group},
                "x_shape": list(static_shape(self.x)), "w_shape": list(static_shape(self.w)),
                "dtype": str(x.dtype).removeprefix("torch."), "matmul": self.mm.name}


def find_gemm_2d(graph: Graph) -> tuple[list[Region2D], list[Skip]]:
    regions, skips = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is MM:
            try:
                region = _region_of(node) or _rs_region_of(node)
            except Unsupported as e:
                if _both_gathered(node) or _rs_candidate(node):  # a 2D candidate after all: say why not
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
                    nodes=[*chain_x, *chain_w], out=mm)


def _rs_candidate(mm: Node) -> tuple[Node, Node] | None:
    """(the all-gather of A, the reduce-scatter of the product) when mm's A is all-gathered along its
    rows and its product goes straight into a reduce-scatter along its rows."""
    a = _gathered(mm.args[0])
    users = list(mm.users)
    if a is None or a[0] is not a[1].args[0] or len(users) != 1:  # a plain (dim 0) gather only
        return None
    rs = users[0]
    if rs.op != "call_function" or rs.target is not REDUCE_SCATTER or rs.args[0] is not mm:
        return None
    if group_name_of(a[0].args[2]) == group_name_of(rs.args[3]):  # one group: 1-D TP, not a candidate
        return None
    return a[0], rs


def _rs_region_of(mm: Node) -> Region2D | None:
    """DTensor's F.linear on a 2D mesh (X and W both [Shard(0), Shard(1)]): X's rows gathered over
    mesh dim 0, X_g @ W_local^T, the partial product reduce-scattered over dim 1 along its rows --
    MeshSlice's rs dataflow with the mesh's axes swapped (Region2D)."""
    found = _rs_candidate(mm)
    if found is None:
        return None
    ag, rs = found
    wait_x = mm.args[0]
    rs_wait = wait_of(rs)
    gather_group, gather_size = group_name_of(ag.args[2]), ag.args[1]
    scatter_group, scatter_size, op = group_name_of(rs.args[3]), rs.args[2], rs.args[1]
    if op != "sum":
        raise Unsupported(f"the product is reduce-scattered with {op!r}, not summed")
    x, b = ag.args[0], mm.args[1]
    xs, bs = x.meta["val"].shape, b.meta["val"].shape
    if not (is_static(list(xs)) and is_static(list(bs))) or len(xs) != 2 or len(bs) != 2:
        raise Unsupported("X and W blocks must be static 2-D")
    if (xs[0] * gather_size) % scatter_size:
        raise Unsupported(f"{xs[0] * gather_size} rows do not scatter over {scatter_size} ranks")
    if x.meta["val"].dtype != b.meta["val"].dtype:
        raise Unsupported("X and W differ in dtype")
    # the op's mesh: rows = the scatter's group (its K blocks), cols = the gather's (its M blocks)
    return Region2D(mm=mm, x=x, w=b, rows_group=scatter_group, cols_group=gather_group, rows=scatter_size,
                    cols=gather_size, nodes=[ag, wait_x, mm, rs, rs_wait], dataflow="rs", out=rs_wait,
                    keep_gathered=list(wait_x.users) != [mm])


def slice_counts(region: Region2D) -> list[int]:
    """The slice counts that cut the sliced dimension's blocks (os: both K blocks; rs: X's M block
    and the output's), at most MAX_SLICES (1: the Collective 2D GEMM)."""
    if region.dataflow == "rs":
        m_block = static_shape(region.x)[0]
        cut = (m_block, m_block * region.cols // region.rows)
    else:
        cut = (static_shape(region.x)[1], static_shape(region.w)[0])
    return [s for s in range(1, MAX_SLICES + 1) if all(d % s == 0 for d in cut)]


def pick_slices(region: Region2D, cluster: GPUCluster | None = None) -> tuple[int, dict[int, float]]:
    """(S, seconds by S) by MeshSlice's cost model of this GEMM on its mesh (a GPU cluster's links:
    NVLink inside a node); the smallest S within 1% of the fastest (fewer, larger pieces)."""
    m, n, k = region.global_mnk
    links = (cluster or GPUCluster()).links((region.rows, region.cols))
    times = {s: meshslice_s(region.dataflow, m, n, k, (region.rows, region.cols), s, links)
             for s in slice_counts(region)}
    best = min(times.values())
    return min(s for s, t in times.items() if t <= best * 1.01), times


def schedule_2d(slices: int, dataflow: str = "os", axis_schedule: str = "") -> str:
    """How explain names a 2D GEMM's schedule."""
    name = "summa" if slices == 0 else "collective (S=1)" if slices == 1 else f"meshslice:{dataflow}:S={slices}"
    return name + (f", {axis_schedule} per axis" if axis_schedule else "")


def rewrite_gemm_2d(graph: Graph, region: Region2D, slices: int, axis_schedule: str = "") -> Node:
    """Replace the region's mm and its collectives by one commopt.gemm_2d call; the node holding
    its product.  axis_schedule: the op's (kernels/mesh2d/ops.py; "" for os and SUMMA)."""
    out = region.out
    with graph.inserting_before(region.mm):
        a = region.x
        if region.dataflow == "rs":  # the op's a is X^T (it makes it contiguous)
            a = graph.call_function(torch.ops.aten.permute.default, (a, [1, 0]))
            a.meta["val"] = region.x.meta["val"].permute(1, 0)
        op = graph.call_function(torch.ops.commopt.gemm_2d.default,
                                 (a, region.w, region.dataflow, slices, region.rows, region.cols,
                                  region.rows_group, region.cols_group, region.keep_gathered, axis_schedule))
        node = graph.call_function(operator.getitem, (op, 0))
    node.meta.update(out.meta)
    if region.keep_gathered:  # the gathered X's other users (the backward's saved tensor) take the op's copy
        wait_x = region.mm.args[0]
        with graph.inserting_after(node):
            gathered = graph.call_function(operator.getitem, (op, 1))
        gathered.meta.update(wait_x.meta)
        wait_x.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not region.mm)
    op.meta["val"] = [node.meta["val"]] + ([gathered.meta["val"]] if region.keep_gathered else [])
    out.replace_all_uses_with(node)
    erase_dead(graph, [*region.nodes, region.mm, out])
    return node
