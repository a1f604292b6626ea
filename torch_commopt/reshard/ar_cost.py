"""Whether CoCoNet's all-reduce split pays, by the cost model (Config.ar_split=True).

The two layouts of one split candidate (passes/matmul/ar_split.py), per rank:

    keep   matmul -> all_reduce (Partial -> Replicate): a `matmul_ar` region, the row-local
           ops on all rows, the consuming GEMMs on the replicated rows (no collective);
    split  matmul -> reduce_scatter (Partial -> Shard(0)): a `matmul_rs` region, the ops on
           1/W of the rows, each value used outside all-gathered (Shard(0) -> Replicate) --
           into the next GEMM as an `ag_matmul` region, else as a plain all-gather.

Each region is costed at its best candidate (tuner.model.rank; device time on a GPU, where
the host runs ahead inside a compiled graph, the back-to-back time on a CPU).  The consuming
GEMMs appear in both layouts, so the split is charged only what its all-gather regions cost
beyond those GEMMs.  Pure arithmetic on shapes: no collectives, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torch_commopt.tuner.calibration import Calibration
from torch_commopt.tuner.matmul.model import RegionShape, collective_time, rank

HBM_BYTES_PER_S = {"cpu": 20e9}  # row-local ops stream their operands once; default below
DEFAULT_HBM_BYTES_PER_S = 3.0e12  # H100/H200-class HBM, achieved


@dataclass(frozen=True)
class SplitShapes:
    """What the decision needs of a candidate (per rank, as matrices: rows x last dim)."""

    rows: int  # rows of the reduced product (cut into W blocks by the split)
    k: int  # contracted dim of the producing GEMM
    n: int  # width of the reduced product
    op_bytes: int  # bytes the row-local ops read and write on all rows
    gathered: tuple[tuple[int, tuple[int, ...]], ...]  # per value used outside: (width, widths of its GEMMs)
    world: int
    dtype: str


@dataclass(frozen=True)
class SplitCost:
    keep_ms: float
    split_ms: float

    @property
    def pays(self) -> bool:
        return self.split_ms < self.keep_ms

    def describe(self) -> str:
        verdict = "split" if self.pays else "kept"
        return f"{verdict}: predicted {self.split_ms:.3f} ms split vs {self.keep_ms:.3f} ms as an all-reduce"


def split_cost(s: SplitShapes, cal: Calibration) -> SplitCost:
    """Predicted ms of the two layouts of a candidate (the parts they share left out)."""
    bw = HBM_BYTES_PER_S.get(cal.device, DEFAULT_HBM_BYTES_PER_S)
    ops_s = s.op_bytes / bw
    keep = _best(RegionShape("matmul_ar", s.rows, s.k, (s.n,), s.world, s.dtype), cal) + ops_s
    split = _best(RegionShape("matmul_rs", s.rows, s.k, (s.n,), s.world, s.dtype), cal) + ops_s / s.world
    local_rows = s.rows // s.world
    elt = getattr(torch, s.dtype).itemsize
    for width, gemms in s.gathered:
        if gemms:  # the all-gather meets its GEMMs: what the region costs beyond them
            region = RegionShape("ag_matmul", local_rows, width, tuple(gemms), s.world, s.dtype)
            split += max(0.0, _best(region, cal) - _gemm_only(cal, s.dtype, s.rows, width, gemms))
        else:
            split += plain_gather_s(s.rows * width * elt, s.world, cal)
    return SplitCost(keep * 1e3, split * 1e3)


def plain_gather_s(full_bytes: float, world: int, cal: Calibration) -> float:
    """What a split pays for all-gathering a value no GEMM takes (`full_bytes`: its whole rows)."""
    return collective_time(cal, "all_gather", full_bytes, world)


def _best(shape: RegionShape, cal: Calibration) -> float:
    preds = rank(shape, cal)
    if cal.device == "cpu":
        return preds[0].seconds
    return min(p.gpu_s for p in preds)


def _gemm_only(cal: Calibration, dtype: str, rows: int, k: int, ns: tuple[int, ...]) -> float:
    fit = cal.gemm_fit(dtype)
    return sum(fit.time(rows, n, k) for n in ns)


def op_bytes(numels: list[int], elt: int) -> int:
    """Bytes a chain of row-local ops moves: each output written once and read once."""
    return 2 * elt * sum(numels)


def rows_of(shape: list[int]) -> int:
    return math.prod(shape[:-1])
