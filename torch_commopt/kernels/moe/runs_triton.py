"""runs.copy_runs as one Triton kernel on CUDA.

A program moves one block of BLOCK_R rows of one run, BLOCK_D columns at a time: the grid is
(runs, blocks of the longest run), and a program past its run's end does nothing.  Every run
is read and written once, at copy speed, where an indexed copy (index_copy_ / index_select over
a per-row index) runs at about half of it on an H200.

Imported on the first CUDA call (runs.py), never at package import.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _runs_kernel(dst_ptr, src_ptr, runs_ptr, first, dst_stride, src_stride, D: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    run = first + tl.program_id(0)
    block = tl.program_id(1)
    s0 = tl.load(runs_ptr + 3 * run)
    d0 = tl.load(runs_ptr + 3 * run + 1)
    n = tl.load(runs_ptr + 3 * run + 2)
    r = block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # 64-bit offsets
    live = r < n
    for c in tl.static_range(0, D, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        mask = live[:, None] & (cols[None, :] < D)
        value = tl.load(src_ptr + (s0 + r)[:, None] * src_stride + cols[None, :], mask=mask)
        tl.store(dst_ptr + (d0 + r)[:, None] * dst_stride + cols[None, :], value, mask=mask)


def copy_runs(dst: Tensor, src: Tensor, runs) -> None:
    """Every run (s, d, n) of `runs` (a runs.RunTable): dst[d : d + n] = src[s : s + n]."""
    width, longest = dst.shape[1], runs.longest
    block_d = min(triton.next_power_of_2(width), 1024)
    block_r = max(1, min(64, 8192 // block_d), triton.next_power_of_2(triton.cdiv(longest, 65535)))
    grid = (len(runs.runs), triton.cdiv(longest, block_r))  # (a grid's second dim takes at most 65535)
    _runs_kernel[grid](dst, src, runs.whole, runs.start, dst.stride(0), src.stride(0), D=width, BLOCK_R=block_r,
                       BLOCK_D=block_d, num_warps=4)
