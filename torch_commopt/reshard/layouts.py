"""Layouts of a region's inputs and outputs over one mesh dimension (the region's group).

Shard(d): each rank holds block `rank` of dim d; Replicate: every rank holds the whole
tensor; Partial(op): every rank holds a partial value, reduced over ranks with `op`.
Regions record the layouts they consume and produce (explain shows them); `reshard` prices
the collective between two layouts (time from a calibration, memory), which the region DAG's
edges (dag.py) and the all-reduce split's two layouts (ar_cost.py) use.
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


@dataclass(frozen=True)
class Reshard:
    """The collective that turns one layout into another over a group of `world` ranks.

    kind: "none", "slice" (local: keep this rank's block), "all_gather", "all_reduce",
    "reduce_scatter", "all_to_all".  time and memory (extra bytes alive during it) come from
    `cost` with a calibration."""

    kind: str
    src: Layout
    dst: Layout
    time: float = 0.0
    memory: float = 0.0

    def __str__(self) -> str:
        return f"{self.src}->{self.dst} ({self.kind})"


def reshard_kind(src: Layout, dst: Layout) -> str:
    """Which collective moves a tensor from `src` to `dst` (ValueError where none can)."""
    if src == dst:
        return "none"
    if isinstance(dst, Partial):
        raise ValueError(f"reshard: nothing produces a partial value from {src}")
    if isinstance(src, Replicate):
        return "slice"  # every rank already holds the whole tensor
    if isinstance(src, Shard):
        return "all_gather" if isinstance(dst, Replicate) else "all_to_all"
    if src.op != "sum":
        raise ValueError(f"reshard: only sum partials are reduced, got {src}")
    return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"


def reshard(src: Layout, dst: Layout, full_bytes: float, world: int, cal=None) -> Reshard:
    """The reshard between two layouts of a tensor of `full_bytes` (its unsharded size), with
    its time from the calibration's ring collectives (tuner.model.collective_time; all-to-all
    as one all-gather step per peer) and the memory it holds: the full tensor where the
    destination is replicated, one shard otherwise."""
    kind = reshard_kind(src, dst)
    if kind in ("none", "slice") or world == 1:
        return Reshard(kind, src, dst)
    from torch_commopt.tuner.matmul.model import collective_time

    if cal is None:
        from torch_commopt.tuner.calibration import prior

        cal = prior("cpu", world)
    if kind == "all_to_all":
        time = cal.collective["all_gather"].time(full_bytes / world / world) * (world - 1)
    else:
        time = collective_time(cal, kind, full_bytes, world)
    memory = full_bytes if isinstance(dst, Replicate) else full_bytes / world
    return Reshard(kind, src, dst, time, memory)
