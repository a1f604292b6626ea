"""runs.copy_runs (and copy_runs2, from two sources) as one Triton kernel on CUDA, and
runs.gather_padded's row gather with empty slots and a device-side flag.

A program moves one block of BLOCK_R rows of one run, BLOCK_D columns at a time: the grid is
(runs, blocks of the longest run), and a program past its run's end does nothing.  Every run
is read and written once, at copy speed, where an indexed copy (index_copy_ / index_select over
a per-row index) runs at about half of it on an H200.

Imported on the first CUDA call (runs.py), never at package import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def copy_runs(dst: Tensor, src: Tensor, runs) -> None:
    """Every run (s, d, n) of `runs` (a runs.RunTable): dst[d : d + n] = src[s : s + n] (the two-source
    kernel with one source: no row of the table is negative)."""
    copy_runs2(dst, src, src, runs)


@triton.jit
def _runs2_kernel(dst_ptr, first_ptr, second_ptr, runs_ptr, start, dst_stride, first_stride, second_stride,
                  D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program moves one block of BLOCK_R rows of one run, BLOCK_D columns at a time, from the
    first source or, where the run's source row is negative, the second at -row - 1 (runs.other);
    the other load is masked off."""
    run = start + tl.program_id(0)
    block = tl.program_id(1)
    s0 = tl.load(runs_ptr + 3 * run)
    d0 = tl.load(runs_ptr + 3 * run + 1)
    n = tl.load(runs_ptr + 3 * run + 2)
    r = block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # 64-bit offsets
    row = tl.zeros_like(r) + s0  # the run's source row, as a block: its sign picks the source
    in_first = row >= 0
    live = r < n
    from_first = live & in_first
    from_second = live & (row < 0)
    s_first = tl.where(in_first, row, 0)
    s_second = tl.where(in_first, 0, -row - 1)
    for c in tl.static_range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        in_cols = cols[None, :] < D
        a = tl.load(first_ptr + (s_first + r)[:, None] * first_stride + cols[None, :],
                    mask=from_first[:, None] & in_cols)
        b = tl.load(second_ptr + (s_second + r)[:, None] * second_stride + cols[None, :],
                    mask=from_second[:, None] & in_cols)
        tl.store(dst_ptr + (d0 + r)[:, None] * dst_stride + cols[None, :], tl.where(from_first[:, None], a, b),
                 mask=live[:, None] & in_cols)


def copy_runs2(dst: Tensor, first: Tensor, second: Tensor, runs) -> None:
    """runs.copy_runs2: every run of `runs` from `first` or (negative source row) `second`."""
    width, longest = dst.shape[1], runs.longest
    block_d = min(triton.next_power_of_2(width), 1024)
    block_r = max(1, min(64, 8192 // block_d), triton.next_power_of_2(triton.cdiv(longest, 65535)))
    grid = (len(runs.runs), triton.cdiv(longest, block_r))
    _runs2_kernel[grid](dst, first, second, runs.whole, runs.start, dst.stride(0), first.stride(0), second.stride(0),
                        D=width, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)


@triton.jit
def _gather_kernel(dst_ptr, src_ptr, index_ptr, flag_ptr, rows, n_src, dst_stride, src_stride, fill,
                   D: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program writes BLOCK_R rows of dst, BLOCK_D columns at a time: row i is src's row index[i],
    zeros where index[i] is n_src (or out of range), every row `fill` where HAS_FLAG and *flag_ptr."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    live = r < rows
    j = tl.load(index_ptr + r, mask=live, other=n_src).to(tl.int64)
    picked = live & (j >= 0) & (j < n_src)
    if HAS_FLAG:
        unflagged = tl.load(flag_ptr + tl.zeros_like(r)) == 0  # the flag, one per row of the block
        picked = picked & unflagged
    j = tl.where(picked, j, 0)
    for c in tl.static_range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        in_cols = cols[None, :] < D
        v = tl.load(src_ptr + j[:, None] * src_stride + cols[None, :], mask=picked[:, None] & in_cols, other=0.0)
        if HAS_FLAG:
            v = tl.where(unflagged[:, None], v, fill).to(v.dtype)
        tl.store(dst_ptr + r[:, None] * dst_stride + cols[None, :], v, mask=live[:, None] & in_cols)


def gather_padded(dst: Tensor, src: Tensor, index: Tensor, flag: Tensor | None, fill: float) -> None:
    """runs.gather_padded on CUDA: one pass over dst's rows (2-D, rows contiguous, src's width and
    dtype; index int32/int64 of dst's rows)."""
    width, rows = dst.shape[1], dst.shape[0]
    block_d = min(triton.next_power_of_2(width), 1024)
    block_r = max(1, min(64, 8192 // block_d))
    flag_bytes = flag.view(torch.uint8) if flag is not None else index  # a bool as a byte (a free view)
    _gather_kernel[(triton.cdiv(rows, block_r),)](
        dst, src, index, flag_bytes, rows, src.shape[0], dst.stride(0), src.stride(0), fill,
        D=width, HAS_FLAG=flag is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
