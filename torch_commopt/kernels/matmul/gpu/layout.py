"""Row layouts shared by the GPU schedules.

A tensor cut or gathered along dim d (not the last) is, as a matrix of rows, an
(outer, W, lin) arrangement: outer = prod(shape[:d]), and each rank owns `lin` consecutive
rows inside every outer block.  With outer == 1 a rank's rows are one contiguous block.
Pieces (chunks) are whole rows for outer == 1 and whole outer blocks otherwise, so a
piece is always contiguous in the rank's own (outer * lin)-row matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    outer: int
    lin: int  # rows per rank inside one outer block
    world: int

    @classmethod
    def of(cls, shape: list[int], dim: int, world: int, *, gathered: bool) -> "RowLayout":
        """For the local shard (gathered=True: dim is gathered) or the full tensor (dim is cut)."""
        outer = math.prod(shape[:dim])
        rows_dim = math.prod(shape[dim:-1])
        return cls(outer, rows_dim if gathered else rows_dim // world, world)

    @property
    def local_rows(self) -> int:
        return self.outer * self.lin

    @property
    def unit(self) -> int:
        """Rows of the smallest piece that stays contiguous in both layouts."""
        return 1 if self.outer == 1 else self.lin

    def chunk_rows(self, chunks: int) -> tuple[int, int]:
        """(rows per piece, piece count): equal pieces of whole units, the last one shorter."""
        units = self.local_rows // self.unit
        per = math.ceil(units / max(1, min(chunks, units))) * self.unit
        return per, math.ceil(self.local_rows / per)

    def pieces(self, chunks: int) -> list[tuple[int, int]]:
        per, n = self.chunk_rows(chunks)
        return [(c * per, min(self.local_rows, (c + 1) * per)) for c in range(n)]

    def block_rows(self, full: torch.Tensor, block: int, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of rank-block `block` of a full (outer*W*lin, X) matrix, as a view
        (outer == 1) or a strided (n_outer, lin, X) view (outer > 1)."""
        if self.outer == 1:
            return full[block * self.lin + lo: block * self.lin + hi]
        # full.view(outer, world, lin, X)[lo // lin: hi // lin, block] as ONE view: a call
        # takes ~10 of these, and view + slice + select cost three dispatches each.
        row, col = full.stride()
        return full.as_strided(((hi - lo) // self.lin, self.lin, full.shape[-1]), (self.world * self.lin * row, row, col),
                               full.storage_offset() + ((lo // self.lin) * self.world + block) * self.lin * row)


def piece_rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of t: t itself when they are all of it (one piece), saving the view a
    slice costs on every use -- at W = 4 a reduce-scatter call indexes ~16 of them, a tenth of
    its host time."""
    return t if lo == 0 and hi == t.shape[0] else t[lo:hi]


def blocks_of(x: torch.Tensor, lo: int, hi: int, lin: int) -> torch.Tensor:
    """Rows [lo, hi) of an (n_outer, lin, X) view of whole outer blocks (lo and hi are multiples
    of lin, as every piece of an outer > 1 layout): its blocks lo // lin to hi // lin."""
    return x if lo == 0 and hi == x.shape[0] * lin else x[lo // lin: hi // lin]


def as_blocks(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (rows, X) `matrix` viewed as (n_outer, lin, X) blocks shaped as 3-D `like`'s first two
    dims (the product's output beside its row blocks, or a piece of rows beside its strided
    destination); `matrix` itself when `like` is 2-D."""
    if like.dim() == 3 and matrix.dim() == 2:
        return matrix.view(like.shape[0], like.shape[1], matrix.shape[-1])
    return matrix


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
