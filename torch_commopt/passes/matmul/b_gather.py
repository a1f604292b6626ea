"""B-side gathers: a matmul whose second operand is all-gathered along its columns, turned around so
that the gather feeds the first operand, where the all-gather -> matmul finder takes it.

    wait(all_gather(b)) -> split(n, dim 0) -> W getitems -> cat(dim 1) = B;  mm(A, B)
becomes
    wait(all_gather(bᵀ, contiguous)) = Bᵀ;  mm(Bᵀ, Aᵀ)ᵀ, contiguous

B's column blocks are the ranks' shards, so the product's column blocks are A times each shard:
gathered along dim 0 after the transpose, they are rows of Bᵀ, and `ag_matmul` multiplies each
rank's rows as they arrive (every schedule it has, GPU ones included).  The backward of a 2D
output-stationary GEMM has this form: DTensor computes dW = Xᵀ dY with dY's column blocks
gathered along the mesh's dim 1 (docs/meshslice.md).  Each output element is the same dot
product as before; only the GEMM's accumulation order may differ, as with any kernel change.
The price is two copies: bᵀ made contiguous for the gather (a shard) and the product laid out
as the graph had it (its readers and the graph's outputs keep their strides).

Taken only where B feeds that one mm and every shape is static; anything else is left as it is.
Runs on every graph when the ag_matmul pattern is on.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from torch_commopt.passes.graph_utils import (
    ALL_GATHER,
    MM,
    WAIT,
    aten,
    cat_dim,
    is_static,
    only_user,
    split_cat_dim,
    static_shape,
    val,
)

PERMUTE = aten.permute.default
CLONE = aten.clone.default


def _b_gather(ag: Node) -> tuple[Node, Node, Node] | None:
    """(wait, cat, mm) when all-gather `ag` is B's column gather of one mm, as the module docstring
    shows; None otherwise."""
    wait = only_user(ag)
    if wait is None or wait.target is not WAIT or val(ag.args[0]) is None:
        return None
    split = only_user(wait)
    form = split_cat_dim(split, ag.args[1]) if split is not None else None
    if form is None or form[0] != 0 or len(static_shape(form[1])) != 2:
        return None
    cat = form[1]
    mm = only_user(cat)
    if cat_dim(cat) != 1 or mm is None or mm.target is not MM or mm.args[1] is not cat or mm.args[0] is cat:
        return None
    if not all(is_static(static_shape(n)) for n in (ag.args[0], mm.args[0], mm)):
        return None
    return wait, cat, mm


def transpose_b_gathers(graph: Graph) -> list[str]:
    """Turn every B-side column gather around (module docstring); one note each."""
    notes = []
    for ag in [n for n in graph.nodes if n.op == "call_function" and n.target is ALL_GATHER]:
        found = _b_gather(ag)
        if found is None:
            continue
        _turn(graph, ag, *found)
        notes.append(f"{found[2].name}: the column gather of its second operand turned into a row gather of "
                     "the first (B-side gather, transposed)")
    return notes


def _turn(graph: Graph, ag: Node, wait: Node, cat: Node, mm: Node) -> None:
    """Rebuild mm(A, cat) as clone(permute(mm(wait(all_gather(clone(permute(b)))), permute(A)))).
    Fake values first (what can fail), then the graph is edited; the new nodes go just before mm,
    where b, A and the group all exist."""
    b, a = ag.args[0], mm.args[0]
    fakes = {"bt": val(b).permute(1, 0)}
    fakes["bt_c"] = fakes["bt"].clone(memory_format=torch.contiguous_format)
    fakes["gathered"] = ALL_GATHER(fakes["bt_c"], *ag.args[1:], **ag.kwargs)
    fakes["at"] = val(a).permute(1, 0)
    fakes["product_t"] = torch.mm(fakes["gathered"], fakes["at"])
    fakes["back"] = fakes["product_t"].permute(1, 0)
    fakes["product"] = fakes["back"].clone(memory_format=torch.contiguous_format)

    def add(name: str, target, *args, **kwargs) -> Node:
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = fakes[name]
        return node

    with graph.inserting_before(mm):
        shard = add("bt_c", CLONE, add("bt", PERMUTE, b, [1, 0]), memory_format=torch.contiguous_format)
        gathered = add("gathered", WAIT, add("gathered", ALL_GATHER, shard, *ag.args[1:], **ag.kwargs))
        product_t = add("product_t", MM, gathered, add("at", PERMUTE, a, [1, 0]))
        product = add("product", CLONE, add("back", PERMUTE, product_t, [1, 0]), memory_format=torch.contiguous_format)
    mm.replace_all_uses_with(product)
    split = cat.args[0][0].args[0]
    getitems = list(cat.args[0])
    for node in [mm, cat, *getitems, split, wait, ag]:
        graph.erase_node(node)
