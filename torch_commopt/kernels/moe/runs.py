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

`gather_padded` is the per-row counterpart for the schedules that move rows by an index (a2a's
reorders, sync_free's blocks): a gather with empty slots, whose backward is a gather by the
index's inverse (exchange.gather_rows), one pass each way.
"""

from __future__ import annotations

from array import array
from itertools import chain

import torch
from torch import Tensor


class RunTable:
    """A table of runs: rows [start, start + len(runs)) of `whole`, an int64 (n, 3) tensor of
    [src row, dst row, rows] on the device that several tables share (one copy brought them all),
    and the same runs as the host keeps them.  Not a tensor view of its own: building one per
    table cost the host more than the kernel launch it feeds."""

    __slots__ = ("whole", "start", "runs")

    def __init__(self, whole: Tensor, start: int, runs: list[tuple[int, int, int]]):
        self.whole, self.start, self.runs = whole, start, runs

    @property
    def longest(self) -> int:
        """The most rows of any run (what the kernel's grid must cover)."""
        return max((n for _, _, n in self.runs), default=0)


def table(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The runs worth moving (no empty one), as the host keeps them."""
    return [r for r in runs if r[2] > 0]


def copy_runs(dst: Tensor, src: Tensor, runs: RunTable) -> None:
    """dst[d : d + n] = src[s : s + n] for every run (s, d, n) of `runs` (a table from
    `on_device`).  Rows of dst outside every run are left as they are."""
    copy_runs2(dst, src, src, runs)  # no source row is negative: every run reads src


def other(row: int) -> int:
    """A run's source row in the second source of copy_runs2, as its table holds it (negative)."""
    return -row - 1


def copy_runs2(dst: Tensor, first: Tensor, second: Tensor, runs: RunTable) -> None:
    """copy_runs from two sources in one move: a run (s, d, n) with s >= 0 reads first[s : s + n],
    one with s < 0 second[other(s) : other(s) + n] (a chunk's pieces, this rank's own and the
    peers' landed in their slots, placed by one launch however many sources)."""
    if not runs.runs:
        return
    if dst.is_cuda and _triton_fits(dst, first) and _triton_fits(dst, second):
        from torch_commopt.kernels.moe import runs_triton

        runs_triton.copy_runs2(dst, first, second, runs)
        return
    for s, d, n in runs.runs:
        src, at = (first, s) if s >= 0 else (second, other(s))
        dst[d: d + n].copy_(src[at: at + n])


class _Staging:
    """A pinned host buffer per device through which on_device's copies go: pinned, so a copy
    queues without a stream sync; kept, so no pinned allocation per call; an event marks the last
    copy out of it, which must have finished before the buffer is written again (a call later, it
    long has)."""

    def __init__(self) -> None:
        self.host: Tensor | None = None
        self.event = None

    def send(self, values: Tensor, device) -> Tensor:
        n = values.numel()
        if self.event is not None:
            self.event.synchronize()
        if self.host is None or self.host.numel() < n:
            self.host = torch.empty(max(n, 4096), dtype=torch.int64, pin_memory=True)
        self.host[:n].copy_(values)
        out = torch.empty(n, dtype=torch.int64, device=device)
        out.copy_(self.host[:n], non_blocking=True)
        if self.event is None:
            self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(device))  # the stream the copy went on (device's)
        return out


_staging: dict[torch.device, _Staging] = {}


def on_device(tables: list[list[tuple[int, int, int]]], device, indexes: tuple[list[int], ...] = ()):
    """Every table on `device` (RunTable) and every index (a plain int64 vector), all from one
    host-to-device copy (through a pinned buffer kept per device on CUDA).  Returns (tables,
    indexes)."""
    flat = array("q", chain.from_iterable(chain.from_iterable(tables)))
    for index in indexes:
        flat.extend(index)
    whole = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.zeros(1, dtype=torch.int64)
    device = torch.device(device)
    if device.type == "cuda":
        whole = _staging.setdefault(device, _Staging()).send(whole, device)
    out, at = [], 0
    for t in tables:
        out.append(RunTable(whole, at, t))
        at += len(t)
    vectors, at = [], 3 * at
    for index in indexes:
        vectors.append(whole[at: at + len(index)])
        at += len(index)
    return out, vectors


def gather_padded(src: Tensor, index: Tensor, flag: Tensor | None = None, fill: float = 0.0) -> Tensor:
    """out[i] = src[index[i]], a zero row where index[i] == len(src) (a slot with no row); every row
    `fill` where `flag` (a one-element bool tensor on src's device) is set, without reading it on
    the host.  On CUDA one pass (runs_triton), where index_select followed by a where for the
    empty rows takes two, and an indexed copy (a gather's usual backward) runs at under half the
    copy speed."""
    out = src.new_empty((index.numel(),) + tuple(src.shape[1:]))
    if out.numel() == 0:
        return out
    if src.is_cuda and src.shape[0] > 0 and index.is_contiguous():
        flat, flat_src = out.view(out.shape[0], -1), src.reshape(src.shape[0], -1)
        if _triton_fits(flat, flat_src):
            from torch_commopt.kernels.moe import runs_triton

            runs_triton.gather_padded(flat, flat_src, index, flag, fill)
            return out
    if src.shape[0] == 0:
        picked = out.zero_()
    else:
        keep = ((index >= 0) & (index < src.shape[0])).view((-1,) + (1,) * (src.dim() - 1))
        picked = torch.where(keep, src.index_select(0, index.clamp(0, src.shape[0] - 1)), src.new_zeros(()))
    return picked if flag is None else torch.where(flag.reshape(()), picked.new_full((), fill), picked)


def _triton_fits(dst: Tensor, src: Tensor) -> bool:
    """Two 2-D tensors of one dtype and width whose rows are contiguous."""
    return (dst.dim() == 2 and src.dim() == 2 and dst.dtype == src.dtype and dst.shape[1] == src.shape[1]
            and dst.stride(1) == 1 and src.stride(1) == 1)
