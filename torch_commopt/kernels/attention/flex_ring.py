"""The reference ring schedule of FlexAttention over a sequence-sharded Q, K and V (plain torch + c10d).

Rank p holds rows and keys [p * L, (p + 1) * L).  Forward: the K/V shares travel round the ring
(comm.ring_shift, W - 1 shifts); at step i rank p attends its rows to source s = (p - i) mod W's
keys under that block's mask (flex.step_mask) and merges the block's (out, lse) into its
accumulator (merge.Accumulator: the first block's partial kept as it came, later ones merged
over the rows their tiles reach).  A block whose mask keeps no tile (flex.extents) is not
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
from torch_commopt.kernels.attention.merge import Accumulator

TAG_KV, TAG_GRAD = 71, 72



def steps_of(blocks: flex.Blocks, world: int, p: int) -> tuple[list[flex.Step], list[flex.Extent | None]]:
    """Rank p's blocks against every source, and where their tiles lie (one host read); built
    once for a mask's tensors (flex.cached)."""

    def build():
        steps = [flex.step_mask(blocks, p, s, world) for s in range(world)]
        return steps, flex.extents(steps)

    return flex.cached(blocks, ("ring", p, world), build)


@dataclass(frozen=True)
class RankBlocks:
    """Rank p's side of the ring: its blocks per source (steps_of), the softmax scale, its rank
    and the ring's size; the order of sources is p, p - 1, ... (its own keys first)."""

    steps: list
    extents: list
    scale: float
    rank: int
    world: int

    def order(self) -> list[int]:
        return [(self.rank - i) % self.world for i in range(self.world)]


def forward_blocks(q: Tensor, v_dim: int, shift, ring: RankBlocks) -> tuple[Tensor, Tensor]:
    """The forward's compute over a K/V shift (comm.ring_shift's interface: current, start,
    wait, finish): (out, lse) as ring_forward gives them."""
    acc_t = acc_dtype(q.dtype)
    order = ring.order()
    computed = [s for s in order if ring.extents[s] is not None]
    acc = Accumulator(q, v_dim, acc_t)
    for i, s in enumerate(order):
        k_s, v_s = shift.current()
        if i < ring.world - 1:
            shift.start()
        if ring.extents[s] is not None:
            block_out, block_lse = flex.block_forward(q, k_s, v_s, ring.steps[s], ring.scale)
            # the first block's partial becomes the accumulator; a later one is merged over the
            # rows its tiles reach only (elsewhere it is empty)
            rows = slice(None) if s == computed[0] else ring.extents[s].rows
            acc.add(rows, block_out[:, :, rows], block_lse[:, :, rows].to(acc_t), last=s == computed[-1])
        if i < ring.world - 1:
            shift.wait()
    shift.finish()
    return acc.result()


def ring_forward(q: Tensor, k: Tensor, v: Tensor, blocks: flex.Blocks, scale: float, group) -> tuple[Tensor, Tensor]:
    """(out, lse) of this rank's rows over the whole sequence: out in q's dtype where at most
    two blocks were computed (the first is kept as it came, the second merged into it in fp32 and
    rounded once), else in the acc dtype; lse in the acc dtype."""
    world, p = comm.size(group), comm.rank(group)
    ring = RankBlocks(*steps_of(blocks, world, p), scale, p, world)
    return forward_blocks(q, v.shape[-1], comm.ring_shift([k, v], group, TAG_KV), ring)


@dataclass(frozen=True)
class Saved:
    """What the backward takes from the forward: the rank's shares and its rows' global out and lse."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def backward_blocks(saved: Saved, dout: Tensor, shifts: tuple, ring: RankBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's compute over shifts = (K/V shift, dK/dV sums' shift): (dq, dk, dv) as
    ring_backward gives them.  dq sums the blocks' terms over the rows each reaches (in q's dtype
    where two or fewer blocks add, one rounding; else the acc dtype); the travelling dK/dV sums
    take each block's over the keys it reaches."""
    q, k, v, out, lse = saved.q, saved.k, saved.v, saved.out, saved.lse
    kv, grads = shifts
    dq = None
    wide = sum(e is not None for e in ring.extents) > 2
    out_q = out.to(q.dtype)
    for i, s in enumerate(ring.order()):
        k_s, v_s = kv.current()
        if i < ring.world - 1:
            kv.start()
        dk_s, dv_s = grads.current()
        if ring.extents[s] is not None:
            gq, gk, gv = flex.block_backward(q, k_s, v_s, out_q, lse, dout, ring.steps[s], ring.scale)
            rows, keys = ring.extents[s].rows, ring.extents[s].keys
            if dq is None:
                dq = gq.to(acc_dtype(q.dtype)) if wide else gq
            else:
                dq[:, :, rows] += gq[:, :, rows]
            dk_s[:, :, keys] += gk[:, :, keys]
            dv_s[:, :, keys] += gv[:, :, keys]
        grads.start()  # block s's sums to the next rank: after W shifts at their owner
        if i < ring.world - 1:
            kv.wait()
        grads.wait()
    kv.finish()
    dk, dv = grads.current()
    grads.finish()
    dq = torch.zeros_like(q) if dq is None else dq
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward(saved: Saved, dout: Tensor, blocks: flex.Blocks, scale: float, group) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares, in the inputs' dtypes."""
    world, p = comm.size(group), comm.rank(group)
    ring = RankBlocks(*steps_of(blocks, world, p), scale, p, world)
    acc = acc_dtype(saved.q.dtype)
    kv = comm.ring_shift([saved.k, saved.v], group, TAG_KV)
    grads = comm.ring_shift([torch.zeros(saved.k.shape, dtype=acc, device=saved.k.device),
                             torch.zeros(saved.v.shape, dtype=acc, device=saved.v.device)], group, TAG_GRAD)
    return backward_blocks(saved, dout, (kv, grads), ring)


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
