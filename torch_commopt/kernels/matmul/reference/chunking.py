"""Which dimension a chunked schedule cuts, shared by the reference schedules and the pass.

Rows are independent in a matmul, so any dim but the last (K for the input, N for the
output) can be cut.  The collective's own dim is preferred (MeshSlice slicing: piece j
of every rank travels together); when it has fewer rows than pieces, or is the last
dim, the largest other row dim is cut instead.
"""

from __future__ import annotations


def chunk_dim(shape: list[int], comm_dim: int | None, rows_per_rank: int | None, chunks: int) -> tuple[int, int]:
    """(dim to cut, rows available along it) for a tensor of `shape`.

    comm_dim: the gather/scatter dim (None for all-reduce); rows_per_rank: the rows of
    comm_dim one piece per rank may take (the local rows of that dim)."""
    row_dims = list(range(len(shape) - 1))
    if comm_dim is not None and comm_dim in row_dims and rows_per_rank >= chunks:
        return comm_dim, rows_per_rank
    best = max(row_dims, key=lambda d: (shape[d], -d))
    if comm_dim is not None and comm_dim == best:
        return best, rows_per_rank
    return best, shape[best]


def ag_chunk_dim(a_shape: list[int], gather_dim: int, chunks: int) -> tuple[int, int]:
    """For all-gather of a local shard `a_shape` along gather_dim."""
    return chunk_dim(a_shape, gather_dim, a_shape[gather_dim], chunks)


def rs_chunk_dim(t_shape: list[int], scatter_dim: int, world: int, chunks: int) -> tuple[int, int]:
    """For reduce-scatter of the full product `t_shape` along scatter_dim."""
    return chunk_dim(t_shape, scatter_dim, t_shape[scatter_dim] // world, chunks)


def ar_chunk_dim(t_shape: list[int], chunks: int) -> tuple[int, int]:
    return chunk_dim(t_shape, None, None, chunks)


def chunk_rows(kind: str, a_shape: list[int], t_shape: list[int] | None, dim: int | None, world: int,
               chunks: int) -> int:
    """Rows along the dim a chunked schedule of this op would cut (the pass and the tune CLI
    bound the candidates' piece counts with it).  t_shape: the product's shape (reductions)."""
    if kind == "ag_matmul":
        return ag_chunk_dim(a_shape, dim, chunks)[1]
    if kind == "matmul_rs":
        return rs_chunk_dim(t_shape, dim, world, chunks)[1]
    return ar_chunk_dim(t_shape, chunks)[1]
