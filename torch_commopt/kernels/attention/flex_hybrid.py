"""The hybrid schedule of FlexAttention context parallelism: Ulysses inside groups of U ranks, a
flex ring over the R groups (hybrid:U:R, U * R = W; plain torch + c10d).

Rank p = g * U + u holds rows and keys [p * L, (p + 1) * L) of every head.  Forward: an all-to-all
over its Ulysses group (the U consecutive ranks of segment g) gives it heads [u * H / U, (u + 1) *
H / U) of the segment's U * L rows, which is share g of the sequence cut in R; the flex ring
(flex_ring.py) then runs over the ring group (the ranks at position u of every segment, in
segment order) with R shares, so the mask is cut in R x R blocks, a block no row of the segment
attends is not computed, and where the mask allows its share is not sent (flex_ring.skipping);
the output and lse go back by the inverse all-to-all.  Backward: q, k, v, out, lse and dout moved
the same way (nothing is kept between the passes), the ring's backward over the segment, and dq,
dk, dv moved back.

Against the ring over all W ranks it sends K/V round a ring of R, not W (the all-to-alls move each
share once), and against Ulysses it needs only U to divide the KV heads.  The mask must be the
whole sequence's (the segment's rows are U ranks' shares) and the same for every head (a head
shard runs the tables of every head).
"""

from __future__ import annotations

from torch import Tensor

from torch_commopt.kernels.attention import comm, flex, flex_ring


def _groups(blocks: flex.Blocks, heads: tuple[int, int], group, u: int, r: int):
    """(Ulysses group, ring group) of this rank, after the checks the schedule needs."""
    if blocks.own_rows:
        raise ValueError(f"flex CP hybrid:{u}:{r}: a mask of this rank's rows only; the hybrid's ring runs a "
                         f"segment of {u} ranks' rows (ring or allgather take it)")
    if blocks.kv_num.shape[1] != 1:
        raise ValueError(f"flex CP hybrid:{u}:{r}: a mask that differs per head; a head shard would need its "
                         "heads' tables (ring or allgather take it)")
    if any(h % u for h in heads):
        raise ValueError(f"flex CP hybrid:{u}:{r}: {u} Ulysses ranks do not split the heads {heads}")
    return comm.hybrid_groups(group, u, r)


def hybrid_forward(q: Tensor, k: Tensor, v: Tensor, blocks: flex.Blocks, scale: float, group,
                   degrees: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the acc dtype) of this rank's rows over the whole sequence."""
    ugroup, rgroup = _groups(blocks, (q.shape[1], k.shape[1]), group, *degrees)
    qh, kh, vh = comm.seq_to_heads([q, k, v], ugroup)
    out, lse = flex_ring.ring_forward(qh, kh, vh, blocks, scale, rgroup)
    out, lse = comm.heads_to_seq([out.to(q.dtype).contiguous(), lse.contiguous()], ugroup)
    return out, lse


def hybrid_backward(saved: flex_ring.Saved, dout: Tensor, blocks: flex.Blocks, scale: float, group,
                    degrees: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares, in the inputs' dtypes."""
    ugroup, rgroup = _groups(blocks, (saved.q.shape[1], saved.k.shape[1]), group, *degrees)
    qh, kh, vh, oh, lh, dh = comm.seq_to_heads([saved.q, saved.k, saved.v, saved.out, saved.lse, dout], ugroup)
    dq, dk, dv = flex_ring.ring_backward(flex_ring.Saved(qh, kh, vh, oh, lh), dh, blocks, scale, rgroup)
    return tuple(comm.heads_to_seq([dq.contiguous(), dk.contiguous(), dv.contiguous()], ugroup))
