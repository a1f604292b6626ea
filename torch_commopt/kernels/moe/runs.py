"""Row runs: copy contiguous runs of rows between two (rows, D) tensors, described by a small table.

by_expert moves a chunk's rows between the layout they travel in (source-major: each source's
piece, expert-major within it) and the padded expert-major buffer the grouped GEMMs read, and
back.  Each (source, expert) pair is one contiguous run on both sides, so a chunk's move is a
few dozen runs, not an index of one entry per row: the table (src row, dst row, rows) per run
is built on the host from the Routing and reaches the GPU in the call's one host-to-device copy,
where an index per row took half a dozen kernels and a pageable copy between the counts' host
read and the first transfer, while the GPU waited (docs/moe.md).

On CUDA one Triton kernel (runs_triton.py) moves every run of a table: a program per (run, block
of rows); elsewhere a loop of slice copies.
"""

from __future__ import annotations

import torch
from torch import Tensor

# a run table: int64 (n, 3) rows [src row, dst row, rows]; its host copy rides along (HOST)
HOST = "_commopt_runs"


def table(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The runs worth moving (no empty one), as the host keeps them."""
    return [r for r in runs if r[2] > 0]


def copy_runs(dst: Tensor, src: Tensor, runs: Tensor) -> None:
    """dst[d : d + n] = src[s : s + n] for every run (s, d, n) of `runs` (a table from
    `on_device`).  Rows of dst outside every run are left as they are."""
    host = getattr(runs, HOST)
    if not host:
        return
    if dst.is_cuda and _triton_fits(dst, src):
        from torch_commopt.kernels.moe import runs_triton

        runs_triton.copy_runs(dst, src, runs, max(n for _, _, n in host))
        return
    for s, d, n in host:
        dst[d: d + n].copy_(src[s: s + n])


def on_device(tables: list[list[tuple[int, int, int]]], device, indexes: tuple[list[int], ...] = ()):
    """Every table on `device`, each a view carrying its host runs, and every index (a plain int64
    vector), all from one host-to-device copy (pinned memory on CUDA: no stream sync).  Returns
    (tables, indexes)."""
    flat = [v for t in tables for run in t for v in run]
    for index in indexes:
        flat.extend(index)
    whole = torch.tensor(flat or [0], dtype=torch.int64)
    if torch.device(device).type == "cuda":
        whole = whole.pin_memory().to(device, non_blocking=True)
    out, at = [], 0
    for t in tables:
        view = whole[at: at + 3 * len(t)].view(len(t), 3)
        setattr(view, HOST, t)
        out.append(view)
        at += 3 * len(t)
    vectors = []
    for index in indexes:
        vectors.append(whole[at: at + len(index)])
        at += len(index)
    return out, vectors


def _triton_fits(dst: Tensor, src: Tensor) -> bool:
    """Two 2-D tensors of one dtype and width whose rows are contiguous."""
    return (dst.dim() == 2 and src.dim() == 2 and dst.dtype == src.dtype and dst.shape[1] == src.shape[1]
            and dst.stride(1) == 1 and src.stride(1) == 1)
