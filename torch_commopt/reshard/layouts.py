"""Layouts of a region's inputs and outputs over one mesh dimension (the region's group).

Shard(d): each rank holds block `rank` of dim d; Replicate: every rank holds the whole
tensor; Partial(op): every rank holds a partial value, reduced over ranks with `op`.
The graph search (reshard issue) will choose between layouts; today regions record them
so explain shows what each operator consumes and produces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def __str__(self) -> str:
        return f"P({self.op})"


Layout = Shard | Replicate | Partial
