"""Index algebra of layout-only ops and all-to-alls: where the elements of a Ulysses program go.

A Ulysses program moves its (sequence-sharded) q, k, v through layout ops, an all-to-all
(sequence -> heads), more layout ops, into attention over the full sequence on H/W heads, and
the output back the mirrored way.  To run such a region as cp_attention_fwd, the rewrite needs
the rank's q, k, v in the op's (B, H, S_loc, D) layout, and the program's result from the op's
output: both are a reshape -> permute -> reshape of the tensors at the region's ends.  This
module finds them exactly, by tracking each tensor's index space as a list of atomic factors.

A Layout is the global tensor (over all ranks) as named factors: `dims` lists, per tensor dim,
its factors in row-major order, and `rank` the factors of the rank index.  A view/reshape
regroups the factors (cutting one into outer x inner parts where a new dim boundary falls
inside it; a cut that does not divide is Unsupported), permute/transpose reorder dims, a clone
changes nothing, and all_to_all_single on dim 0 over W ranks swaps the rank factors with dim
0's leading W part (rank p's output chunk i is rank i's input chunk p).

Factor names are shared through one Atoms registry, which records every cut, so a factor seen
whole at one end and cut at the other resolves to the same leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.fx import Node

from torch_commopt.passes.graph_utils import RESHAPES, Unsupported, aten, static_shape

IDENTITY_OPS = {aten.clone.default, aten.alias.default}


@dataclass
class Atoms:
    """Factor names -> sizes, and the cuts made so far (name -> (outer, inner))."""

    sizes: dict[str, int] = field(default_factory=dict)
    cuts: dict[str, tuple[str, str]] = field(default_factory=dict)

    def new(self, name: str, size: int) -> list[str]:
        """A fresh factor ([] for size 1: a size-1 factor indexes nothing)."""
        if size == 1:
            return []
        self.sizes[name] = size
        return [name]

    def cut(self, name: str, outer: int) -> tuple[str, str]:
        """Cut factor `name` into (outer part of size `outer`, inner part)."""
        if name in self.cuts:
            raise ValueError(f"layout algebra: factor {name} is cut already (cut leaves only)")
        o, i = f"{name}.o", f"{name}.i"
        self.sizes[o], self.sizes[i] = outer, self.sizes[name] // outer
        self.cuts[name] = (o, i)
        return o, i

    def leaves(self, names: Sequence[str]) -> list[str]:
        out = []
        for n in names:
            out += self.leaves(self.cuts[n]) if n in self.cuts else [n]
        return out

    def size(self, names: Sequence[str]) -> int:
        return math.prod(self.sizes[n] for n in names)


@dataclass
class Layout:
    atoms: Atoms
    dims: list[list[str]]
    rank: list[str]

    @classmethod
    def fresh(cls, atoms: Atoms, prefix: str, shape: Sequence[int], rank: list[str]) -> "Layout":
        return cls(atoms, [atoms.new(f"{prefix}{i}", s) for i, s in enumerate(shape)], rank)

    def shape(self) -> list[int]:
        return [self.atoms.size(d) for d in self.dims]

    def regroup(self, sizes: Sequence[int]) -> "Layout":
        """The layout after a view/reshape to `sizes` (row-major regrouping of the factors)."""
        queue = self.atoms.leaves([f for d in self.dims for f in d])  # leaves: never cut twice
        dims = []
        for want in sizes:
            dim, left = [], want
            while left > 1:
                if not queue:
                    raise Unsupported(f"reshape to {list(sizes)}: sizes do not match {self.shape()}")
                f = queue.pop(0)
                n = self.atoms.sizes[f]
                if left % n == 0:
                    dim.append(f)
                    left //= n
                elif n % left == 0:
                    outer, inner = self.atoms.cut(f, left)
                    dim.append(outer)
                    queue.insert(0, inner)
                    left = 1
                else:
                    raise Unsupported(f"reshape to {list(sizes)} splits a dim of size {n} by {left}")
            dims.append(dim)
        if queue:
            raise Unsupported(f"reshape to {list(sizes)}: sizes do not match {self.shape()}")
        return Layout(self.atoms, dims, self.rank)

    def permute(self, order: Sequence[int]) -> "Layout":
        n = len(self.dims)
        return Layout(self.atoms, [self.dims[d % n] for d in order], self.rank)

    def all_to_all(self, world: int) -> "Layout":
        """all_to_all_single with equal splits of dim 0 over `world` ranks."""
        head = self.regroup([world, self.shape()[0] // world] + self.shape()[1:])
        return Layout(self.atoms, [self.rank + head.dims[1]] + head.dims[2:], head.dims[0])

    def through(self, path: Sequence[Node]) -> "Layout":
        """The layout after the layout-only ops of `path` (detect.LAYOUT_OPS)."""
        lay = self
        for op in path:
            t, out = op.target, static_shape(op)
            if t is aten.permute.default:
                lay = lay.permute(op.args[1])
            elif t is aten.transpose.int:
                order = list(range(len(lay.dims)))
                a, b = (d % len(order) for d in op.args[1:3])
                order[a], order[b] = order[b], order[a]
                lay = lay.permute(order)
            elif t in IDENTITY_OPS or (t is aten.expand.default and out == lay.shape()):
                pass
            elif t in RESHAPES or t in (aten.unsqueeze.default, aten.squeeze.dim):
                lay = lay.regroup(out)
            else:
                raise Unsupported(f"{op.name} ({t}) moves elements in a way the layout algebra does not follow")
            if lay.shape() != list(out):
                raise Unsupported(f"{op.name}: layout algebra gives {lay.shape()}, the graph {list(out)}")
        return lay


@dataclass(frozen=True)
class Relayout:
    """x.reshape(split).permute(order).reshape(shape): how one end becomes the other."""

    split: tuple[int, ...]
    order: tuple[int, ...]
    shape: tuple[int, ...]

    def is_identity(self) -> bool:
        return list(self.order) == sorted(self.order)


def relayout(atoms: Atoms, source: Sequence[str], target: Sequence[Sequence[str]]) -> Relayout:
    """The Relayout from a tensor whose factors are `source` (row-major) to one with dims `target`
    (each a factor list).  Unsupported unless both hold the same factors."""
    src, dst = atoms.leaves(source), [atoms.leaves(d) for d in target]
    flat = [f for d in dst for f in d]
    if sorted(src) != sorted(flat):
        raise Unsupported(f"the region's ends hold different elements ({sorted(src)} vs {sorted(flat)})")
    return Relayout(tuple(atoms.sizes[f] for f in src), tuple(src.index(f) for f in flat),
                    tuple(atoms.size(d) for d in dst))
