"""The reference ring schedule of FlexAttention over a sequence-sharded Q, K and V (plain torch + c10d).

Rank p holds rows and keys [p * L, (p + 1) * L).  Forward: the K/V shares travel round the ring
(comm.ring_shift, W - 1 shifts); at step i rank p attends its rows to source s = (p - i) mod W's
keys under that block's mask (flex.step_mask) and merges the block's (out, lse) into its
accumulator in the acc dtype (merge.merge_).  A block whose mask keeps no tile (flex.work) is not
computed: a sliding window or a document boundary leaves most of a long sequence's blocks empty.
Backward: the K/V shares travel round again, with their dK/dV sums in the acc dtype one step
behind them; each rank adds its block's terms, computed from its rows' *global* out and LSE, and
the sums reach their owner after W shifts.  Every block is sent whatever its mask (skipping sends
needs the mask on the host of every rank; a later schedule).

The mask is the program's whole-sequence BlockMask and its mask_mod of global positions
(flex.Blocks); every rank holds it, as a program that builds it from document ids on every rank
does.  The GPU schedules are checked against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torch_commopt.kernels.attention import comm, flex
from torch_commopt.kernels.attention.local import acc_dtype
from torch_commopt.kernels.attention.merge import merge_

TAG_KV, TAG_GRAD = 71, 72



def ring_forward(q: Tensor, k: Tensor, v: Tensor, blocks: flex.Blocks, scale: float, group) -> tuple[Tensor, Tensor]:
    """(out in the acc dtype, lse) of this rank's rows over the whole sequence."""
    world, p = comm.size(group), comm.rank(group)
    need = flex.row_work(blocks, world, p)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    shift = comm.ring_shift([k, v], group, TAG_KV)
    for i in range(world):
        s = (p - i) % world
        k_s, v_s = shift.current()
        if i < world - 1:
            shift.start()
        if need[s] > 0:
            block_out, block_lse = flex.block_forward(q, k_s, v_s, flex.step_mask(blocks, p, s, world), scale)
            merge_(out, lse, block_out, block_lse.to(acc))
        if i < world - 1:
            shift.wait()
    shift.finish()
    return out, lse


@dataclass(frozen=True)
class Saved:
    """What the backward takes from the forward: the rank's shares and its rows' global out and lse."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def ring_backward(saved: Saved, dout: Tensor, blocks: flex.Blocks, scale: float, group) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares, in the inputs' dtypes."""
    q, k, v, out, lse = saved.q, saved.k, saved.v, saved.out, saved.lse
    world, p = comm.size(group), comm.rank(group)
    need = flex.row_work(blocks, world, p)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    out_q = out.to(q.dtype)
    kv = comm.ring_shift([k, v], group, TAG_KV)
    grads = comm.ring_shift([torch.zeros(k.shape, dtype=acc, device=k.device),
                             torch.zeros(v.shape, dtype=acc, device=v.device)], group, TAG_GRAD)
    for i in range(world):
        s = (p - i) % world
        k_s, v_s = kv.current()
        if i < world - 1:
            kv.start()
        dk_s, dv_s = grads.current()
        if need[s] > 0:
            gq, gk, gv = flex.block_backward(q, k_s, v_s, out_q, lse, dout, flex.step_mask(blocks, p, s, world), scale)
            dq += gq
            dk_s += gk
            dv_s += gv
        grads.start()  # block s's sums to the next rank: after W shifts at their owner
        if i < world - 1:
            kv.wait()
        grads.wait()
    kv.finish()
    dk, dv = grads.current()
    grads.finish()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlexRing(torch.autograd.Function):
    """Ring FlexAttention with autograd: forward(q, k, v, blocks, scale, group) -> out in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, group):
        out, lse = ring_forward(q, k, v, blocks, scale, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale, ctx.group = blocks, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(Saved(*ctx.saved_tensors), dout.contiguous(), ctx.blocks, ctx.scale, ctx.group)
        return dq, dk, dv, None, None, None


def flex_ring(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float | None, group) -> Tensor:
    """FlexAttention of this rank's rows (q, k, v: (B, H, L, D), (B, H_kv, L, D), the rank's shares
    of the sequence) under `block_mask` (the whole sequence's BlockMask, or this rank's rows
    against the whole sequence's keys), over the ring."""
    blocks = flex.Blocks.of(block_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return FlexRing.apply(q, k, v, blocks, scale, group)
