"""Find matmul -> reduce-scatter (`matmul_rs`) and matmul -> all-reduce (`matmul_ar`) regions.

Forms recognised in post-grad graphs:
  mm/addmm/_scaled_mm -> row-preserving chain -> reduce_scatter_tensor -> wait_tensor  (scatter dim 0)
  mm/addmm -> chain -> split(L, dim d) -> W getitems -> cat(dim 0) -> reduce_scatter_tensor
                                                                           (scatter dim d)
  mm/addmm -> chain -> all_reduce -> wait_tensor
Every intermediate node must have the next one as its only user: a partial product
used elsewhere cannot be folded into the op.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from torch_commopt.core.groups import resolve_group
from torch_commopt.passes.chains import keeps_last_dim
from torch_commopt.passes.graph_utils import (
    ADDMM,
    ALL_REDUCE,
    MM,
    REDUCE_SCATTER,
    SCALED_MM,
    SPLITS,
    Unsupported,
    aten,
    cat_dim,
    divides,
    group_name_of,
    is_getitem,
    only_user,
    row_shape,
    split_cat_dim,
    static_shape,
    wait_of,
)
from torch_commopt.passes.matmul.scaled_mm import scaled_operands
from torch_commopt.passes.regions import Consumer, Region
from torch_commopt.report import Skip
from torch_commopt.reshard.layouts import Partial, Replicate, Shard

REDUCE_OPS = ("sum", "avg")


def find_matmul_reduce(graph: Graph, kinds: tuple[str, ...]) -> tuple[list[Region], list[Skip]]:
    targets = {REDUCE_SCATTER: "matmul_rs", ALL_REDUCE: "matmul_ar"}
    regions, skips = [], []
    for node in graph.nodes:
        kind = targets.get(node.target) if node.op == "call_function" else None
        if kind not in kinds:
            continue
        try:
            regions.append(_region_of(node, kind))
        except Unsupported as e:
            skips.append(Skip(kind, node.name, str(e)))
    return regions, skips


def _region_of(coll: Node, kind: str) -> Region:
    if kind == "matmul_rs":
        reduce_op, world, group_name = coll.args[1], coll.args[2], group_name_of(coll.args[3])
    else:
        reduce_op, group_name = coll.args[1], group_name_of(coll.args[2])
        world = None
    if reduce_op not in REDUCE_OPS:
        raise Unsupported(f"reduce op {reduce_op!r} is not one of {REDUCE_OPS}")
    wait = wait_of(coll)
    t, scatter_dim, nodes = coll.args[0], 0, [coll, wait]
    if kind == "matmul_rs" and (form := scatter_form(t, world)) is not None:
        t, scatter_dim, extra = form
        nodes += extra
    mm, path = _walk_back(t)
    a, weight, bias, scaled = _operands(mm)
    t_shape = row_shape(t)
    if kind == "matmul_rs" and not divides(t_shape[scatter_dim], world):
        raise Unsupported(f"scatter dim {scatter_dim} of size {t_shape[scatter_dim]} is not divisible by {world}")
    if world is None:
        try:
            world = resolve_group(group_name).size()
        except Exception as e:
            raise Unsupported(f"cannot resolve process group {group_name!r} ({type(e).__name__})") from e
    return Region(
        kind=kind, collective=coll, wait=wait, group_name=group_name, group_size=world,
        dim=scatter_dim if kind == "matmul_rs" else None, a=a, reduce_op=reduce_op,
        consumers=[Consumer(node=mm, path=[], weight=weight, bias=bias, scaled=scaled)], path=path,
        nodes=nodes + path + [mm], in_layout=Partial(reduce_op),
        out_layout=Shard(scatter_dim) if kind == "matmul_rs" else Replicate(),
        t_shape=t_shape,
    )


def scatter_form(x: Node, world: int) -> tuple[Node, int, list[Node]] | None:
    """x = cat(split(t, L, dim d), dim 0): the form of a scatter along d > 0."""
    if x.target is not aten.cat.default or cat_dim(x) != 0 or only_user(x) is None:
        return None
    pieces = list(x.args[0])
    if not pieces or not all(is_getitem(p) for p in pieces):
        return None
    split = pieces[0].args[0]
    if split.target not in SPLITS:
        return None
    form = split_cat_dim(split, world)
    if form is None or form[1] is not x or len(split.args[0].users) != 1:
        return None
    return split.args[0], form[0], [x, *pieces, split]


def _walk_back(t: Node) -> tuple[Node, list[Node]]:
    """From the collective's input back to the matmul through single-user row-preserving ops."""
    if len(t.users) != 1:
        raise Unsupported(f"{t.name} has other users besides the collective")
    path, node = [], t
    while node.op == "call_function" and node.target not in (MM, ADDMM, SCALED_MM):
        if not keeps_last_dim(node):
            raise Unsupported(f"the collective's input comes from {node.target}, not from a matmul through views")
        path.insert(0, node)
        node = node.args[0]
        if len(node.users) != 1:
            raise Unsupported(f"{node.name} has other users besides the path to the collective")
    if node.op != "call_function":
        raise Unsupported("the collective's input is not produced by a matmul")
    if len(node.users) != 1:
        raise Unsupported(f"matmul {node.name} has other users besides the collective")
    return node, path


def _operands(mm: Node):
    """(A, weight, bias, float8 arguments or None) of the matmul."""
    if mm.target is SCALED_MM:
        return scaled_operands(mm)
    if mm.target is MM:
        return mm.args[0], mm.args[1], None, None
    if mm.kwargs:
        raise Unsupported(f"addmm {mm.name} has beta/alpha")
    bias, a, weight = mm.args[0], mm.args[1], mm.args[2]
    if static_shape(bias) != [static_shape(weight)[-1]]:
        raise Unsupported(f"addmm {mm.name} bias is not a vector over the output columns")
    return a, weight, bias, None
