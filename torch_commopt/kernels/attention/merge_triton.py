"""merge.merge_ as one Triton kernel on CUDA: one read of each operand, one write of out and lse.

The torch version makes ~8 passes over the (B, H, S, D) fp32 accumulator.  This kernel reads
out, out_b, lse, lse_b once and writes out and lse once: at B1 H32 S8K D128 with a bf16
partial, 0.137 vs 0.352 ms on an H200 (docs/context-parallel-attention.md).
A half-precision out (a last merge, merge.Accumulator) is computed in fp32 and rounded once.  Same semantics: a row
whose lse is -inf on one side takes the other side as is; two -inf sides stay (0, -inf).

Imported on the first CUDA merge (merge.py), never at package import.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, ob_ptr, lb_ptr, rows, heads, seq, dim,
                  o_sb, o_sh, o_ss, l_sb, l_sh, l_ss, ob_sb, ob_sh, ob_ss, lb_sb, lb_sh, lb_ss,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # 64-bit offsets
    live = r < rows
    b = r // (heads * seq)
    h = (r // seq) % heads
    s = r % seq
    lse_a = tl.load(lse_ptr + b * l_sb + h * l_sh + s * l_ss, mask=live, other=float("-inf"))
    lse_b = tl.load(lb_ptr + b * lb_sb + h * lb_sh + s * lb_ss, mask=live, other=float("-inf")).to(tl.float32)
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(lse_a - m_safe)  # exp(-inf) = 0: an empty side weighs nothing
    wb = tl.exp(lse_b - m_safe)
    total = wa + wb
    empty = total == 0.0
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    new_lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
    d = tl.arange(0, BLOCK_D)
    dmask = live[:, None] & (d[None, :] < dim)
    o_off = (b * o_sb + h * o_sh + s * o_ss)[:, None] + d[None, :]
    ob_off = (b * ob_sb + h * ob_sh + s * ob_ss)[:, None] + d[None, :]
    o = tl.load(out_ptr + o_off, mask=dmask, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + ob_off, mask=dmask, other=0.0).to(tl.float32)
    merged = (o * (wa * inv)[:, None] + ob * (wb * inv)[:, None])
    merged = tl.where(empty[:, None], o, merged)
    tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=dmask)  # half out: rounded once
    tl.store(lse_ptr + b * l_sb + h * l_sh + s * l_ss, new_lse, mask=live)


def fits(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> bool:
    """Whether the kernel takes these operands: CUDA, lse float32, out float32 or half (a last
    merge), the head dim contiguous in out and out_b, 4-D / 3-D shapes that agree."""
    return (out.is_cuda and out.dim() == 4 and lse.dtype == lse_b.dtype == torch.float32
            and out.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and out_b.shape == out.shape and lse.shape == lse_b.shape == out.shape[:3]
            and out.stride(-1) == 1 and out_b.stride(-1) == 1 and out.shape[-1] <= 512)


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """In place, as merge.merge_ (see there); the operands must pass fits()."""
    bsz, heads, seq, dim = out.shape
    rows = bsz * heads * seq
    if rows == 0:
        return out, lse
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(64, 8192 // block_d))
    _merge_kernel[(triton.cdiv(rows, block_r),)](
        out, lse, out_b, lse_b, rows, heads, seq, dim, *out.stride()[:3], *lse.stride(), *out_b.stride()[:3],
        *lse_b.stride(), BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out, lse
