"""Where the experts' axis runs through a fixed-capacity MoE's graph, between its two all-to-alls.

A fixed-capacity MoE (GShard, Switch, DeepSpeed-MoE's `MOELayer`) lays its tokens out as
[ranks, local experts, capacity, dim], exchanges them with `all_to_all_single` on equal splits,
runs its local experts as batched GEMMs over [local experts, ranks x capacity, dim] and sends the
outputs back the same way.  What lies between the two exchanges is written by the model (views,
transposes, the experts' activation), so it is read here, not matched against one form.

Every dim of every tensor between them is a list of *atoms*, outer to inner: the factors its
size is made of.  The first exchange's output starts as [[source, rows a source], [dim]...]; a
reshape groups consecutive atoms into dims and splits an atom where a dim boundary falls inside
it (the split holds for every tensor that has the atom, so the exchange's rows come out as
[source, expert, slot] once the program views them that way).  The experts' axis is the atom of
the first batched GEMM's batch dim.  The region can run in chunks of experts when that atom
stays whole and every op treats it as a batch axis: a batched GEMM's batch (or the rows of a
product), never a contracted dim, never reduced; an operand from outside the region that meets
it at full size is sliced with it (elementwise and batched-GEMM semantics pair element e with
element e, so the slice is exact whatever that operand means).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

from torch_commopt.passes.graph_utils import BMM, MM, RESHAPES, Unsupported, aten, descendants, static_shape

LAYOUT_SAME = {aten.clone.default, aten.alias.default, torch.ops.prims.convert_element_type.default,
               aten._to_copy.default, aten.contiguous.default}


class Atoms:
    """Atom sizes and splits (an atom split into [outer, inner] stands for both everywhere)."""

    def __init__(self) -> None:
        self.size: dict[int, int] = {}
        self.parts: dict[int, list[int]] = {}

    def new(self, n: int) -> int:
        a = len(self.size)
        self.size[a] = n
        return a

    def leaves(self, a: int) -> list[int]:
        return [a] if a not in self.parts else [x for p in self.parts[a] for x in self.leaves(p)]

    def dims(self, layout: list[list[int]]) -> list[list[int]]:
        return [[x for a in dim for x in self.leaves(a)] for dim in layout]

    def fresh(self, shape) -> list[list[int]]:
        return [[self.new(int(s))] if int(s) != 1 else [] for s in shape]

    def reshape(self, layout: list[list[int]], shape) -> list[list[int]] | None:
        """`layout` viewed as `shape` (row-major), splitting atoms at dim boundaries; None when a
        boundary does not divide an atom."""
        seq = [a for dim in self.dims(layout) for a in dim]
        out, i = [], 0
        for s in (int(x) for x in shape):
            dim, prod = [], 1
            while prod < s:
                if i >= len(seq) or s % prod:
                    return None
                a = seq[i]
                n = self.size[a]
                if prod * n > s:
                    r = s // prod
                    if n % r:
                        return None
                    hi, lo = self.new(r), self.new(n // r)
                    self.parts[a] = [hi, lo]
                    seq[i:i + 1] = [hi, lo]
                    a = hi
                dim.append(a)
                prod *= self.size[a]
                i += 1
            if prod != s:
                return None
            out.append(dim)
        return out if i == len(seq) else None


@dataclass
class Slice:
    """An operand from outside the region that meets the experts' axis at full size: its dim
    `dim` is cut as the region's own tensor's dim of atoms `atoms` is."""

    node: Node  # the region node that reads it
    arg: int  # its position among node.args
    dim: int
    atoms: list[int]


@dataclass
class Analysis:
    atoms: Atoms
    layout: dict[Node, list[list[int]]]  # every region node's dims (atoms as first recorded)
    expert: int  # the experts' atom
    slices: list[Slice] = field(default_factory=list)

    def dims(self, node: Node) -> list[list[int]]:
        return self.atoms.dims(self.layout[node])

    def expert_dim(self, node: Node) -> int:
        """The dim of `node` that holds the experts' atom."""
        return next(j for j, dim in enumerate(self.dims(node)) if self.expert in dim)


def _tensor(a) -> bool:
    return isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _pointwise(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def _step(atoms: Atoms, node: Node, layout: dict) -> list[list[int]]:
    """The node's dims from its inputs' (first pass: shapes only)."""
    t, a0 = node.target, node.args[0] if node.args else None
    shape = static_shape(node)
    mine = layout.get(a0) if isinstance(a0, Node) else None
    if t in RESHAPES:
        out = atoms.reshape(mine, shape)
        if out is None:
            raise Unsupported(f"{node.name} reshapes {static_shape(a0)} to {shape} across the rows' factors")
        return out
    if t is aten.permute.default:
        return [mine[d % len(mine)] for d in node.args[1]]
    if t in LAYOUT_SAME or (_pointwise(node) and sum(_tensor(a) for a in node.args) == 1 and mine is not None):
        return [list(d) for d in mine]
    if t is aten.unsqueeze.default:
        d = node.args[1] % (len(mine) + 1)
        return mine[:d] + [[]] + mine[d:]
    if t is aten.squeeze.dim and shape != static_shape(a0):
        return mine[:node.args[1] % len(mine)] + mine[node.args[1] % len(mine) + 1:]
    if t in (BMM, MM):
        a, b = (layout.get(x) for x in node.args[:2])
        fa = a if a is not None else atoms.fresh(static_shape(node.args[0]))
        fb = b if b is not None else atoms.fresh(static_shape(node.args[1]))
        batch = [(fa if a is not None else fb)[0]] if t is BMM else []
        return batch + [fa[-2], fb[-1]]
    if _pointwise(node):
        return _broadcast(atoms, node, layout, shape)
    raise Unsupported(f"{node.name} ({getattr(t, '__name__', t)}) is not an op the experts' chunks can run")


def _broadcast(atoms: Atoms, node: Node, layout: dict, shape: list[int]) -> list[list[int]]:
    out = []
    for j in range(len(shape)):
        dim = None
        for a in node.args:
            if _tensor(a) and a in layout:
                s = static_shape(a)
                k = j - (len(shape) - len(s))
                if k >= 0 and s[k] == shape[j] and shape[j] != 1:
                    dim = layout[a][k]
                    break
        out.append(list(dim) if dim is not None else atoms.fresh([shape[j]])[0])
    return out


def analyse(wait: Node, region: list[Node], world: int) -> Analysis:
    """The layouts of `region` (the nodes from the first exchange's wait to the second exchange's
    input, in graph order) and the experts' atom; raises Unsupported with the reason."""
    atoms, layout = Atoms(), {}
    shape = static_shape(wait)
    rows = shape[0] // world
    layout[wait] = [[atoms.new(world)] + ([atoms.new(rows)] if rows > 1 else [])] + atoms.fresh(shape[1:])
    for node in region:
        if node is not wait:
            layout[node] = _step(atoms, node, layout)
    first = next((n for n in region if n.target is BMM), None)
    if first is None:
        raise Unsupported("no batched GEMM (the experts) between the two all-to-alls")
    batch = atoms.dims(layout[first])[0]
    if len(batch) != 1:
        raise Unsupported(f"{first.name}'s batch dim is not one factor of the exchanged rows")
    found = Analysis(atoms, layout, batch[0])
    if found.expert not in atoms.dims(layout[wait])[0][1:]:
        raise Unsupported(f"{first.name}'s batch dim does not come from the exchanged rows")
    for node in region:
        _check(found, node)
    return found


def _check(found: Analysis, node: Node) -> None:
    """The experts' axis through `node` (second pass: the atoms are final)."""
    e = found.expert
    dims = found.dims(node)
    if not any(e in d for d in dims):
        raise Unsupported(f"{node.name} loses the experts' axis")
    if node.target in (BMM, MM):
        a, b = node.args[:2]
        for x, k in ((a, -1), (b, -2)):
            if x in found.layout and e in found.dims(x)[k]:
                raise Unsupported(f"{node.name} contracts over the experts' axis")
        if node.target is BMM and e in dims[0]:
            for i, x in enumerate((a, b)):
                if x not in found.layout:
                    found.slices.append(Slice(node, i, 0, dims[0]))
                elif found.dims(x)[0] != dims[0]:
                    raise Unsupported(f"{node.name} pairs different batch layouts")
        return
    if _pointwise(node):
        for i, x in enumerate(node.args):
            if not _tensor(x):
                continue
            s = static_shape(x)
            for j, dim in enumerate(dims):
                k = j - (len(dims) - len(s))
                if k < 0 or e not in dim or s[k] == 1:
                    continue
                if x not in found.layout:
                    found.slices.append(Slice(node, i, k, dim))
                elif found.dims(x)[k] != dim:
                    raise Unsupported(f"{node.name} pairs the experts' axis with another layout")


def region_between(wait: Node, a2a: Node) -> list[Node]:
    """The nodes on a path from `wait` (the first exchange's) to `a2a`'s input, in graph order."""
    down = descendants(wait, stop=a2a) | {wait}
    up, stack = set(), [a2a.args[0]]
    while stack:
        n = stack.pop()
        if isinstance(n, Node) and n in down and n not in up:
            up.add(n)
            stack.extend(x for x in n.all_input_nodes)
    return [n for n in wait.graph.nodes if n in up]
