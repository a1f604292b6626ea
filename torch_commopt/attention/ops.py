"""`torch.ops.commopt.cp_attention_fwd` / `cp_attention_bwd`, and `cp_attention` for eager use.

The ops name their group by string and carry its size (as the other commopt ops do), so the
fake impls can give exact shapes and refuse a schedule at trace time.  A graph pass inserts
the forward op into the forward graph and the backward op into the backward graph; eager code
and tests use `cp_attention`, an autograd.Function over the two.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_commopt.attention import schedules
from torch_commopt.attention.local import acc_dtype
from torch_commopt.attention.spec import CPSchedule
from torch_commopt.kernels.reference.collectives import resolve_group

# A fragment of the commopt namespace (kernels/ops.py holds its DEF library).  Plain
# torch.library.Library, as there: the ops need no autograd formula (cp_attention is the
# autograd wrapper) and custom_op's per-call wrappers would cost host time.
_LIB = torch.library.Library("commopt", "FRAGMENT")
_LIB.define("cp_attention_fwd(Tensor q, Tensor k, Tensor v, str schedule, bool causal, float? scale, "
            "int group_size, str group_name, str backend='auto', str layout='contiguous') -> (Tensor, Tensor)")
_LIB.define("cp_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str schedule, "
            "bool causal, float? scale, int group_size, str group_name, str backend='auto', "
            "str layout='contiguous') -> (Tensor, Tensor, Tensor)")


def _group(group_size: int, group_name: str):
    group = resolve_group(group_name)
    if group.size() != group_size:
        raise ValueError(f"commopt cp_attention: group {group_name} has {group.size()} ranks, the op says {group_size}")
    return group


def cp_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, schedule: str, causal: bool, scale: Optional[float],
                        group_size: int, group_name: str, backend: str = "auto",
                        layout: str = "contiguous") -> tuple[Tensor, Tensor]:
    """Context-parallel attention forward on this rank's shards of the sequence (`layout`:
    "contiguous", or "zigzag" -- schedules.SEQUENCE_LAYOUTS).

    q: (B, H, S_loc, D); k: (B, H_kv, S_loc, D); v: (B, H_kv, S_loc, Dv).
    Returns out (B, H, S_loc, Dv) in q's dtype, lse (B, H, S_loc) float32 (float64 for float64 q).
    """
    out, lse = schedules.cp_attention_fwd(q, k, v, schedule=schedule, causal=causal, scale=scale,
                                          group=_group(group_size, group_name), backend=backend, layout=layout)
    return out.contiguous(), lse.contiguous()  # what the fake impl promises


def cp_attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, schedule: str,
                        causal: bool, scale: Optional[float], group_size: int, group_name: str,
                        backend: str = "auto", layout: str = "contiguous") -> tuple[Tensor, Tensor, Tensor]:
    """Context-parallel attention backward: dout, out (B, H, S_loc, Dv), lse (B, H, S_loc) of the
    forward; q, k, v as there.  Returns dq, dk, dv shaped and typed as q, k, v."""
    grads = schedules.cp_attention_bwd(dout, q, k, v, out, lse, schedule=schedule, causal=causal, scale=scale,
                                       group=_group(group_size, group_name), backend=backend, layout=layout)
    return tuple(g.contiguous() for g in grads)  # what the fake impl promises


_LIB.impl("cp_attention_fwd", cp_attention_fwd_op, "CompositeExplicitAutograd")
_LIB.impl("cp_attention_bwd", cp_attention_bwd_op, "CompositeExplicitAutograd")


def _refuse_at_trace(schedule, q, k, v, group_size, causal, layout) -> None:
    schedules.check(CPSchedule.parse(schedule), q, k, v, group_size, causal, layout)


@torch.library.register_fake("commopt::cp_attention_fwd")
def _(q, k, v, schedule, causal, scale, group_size, group_name, backend="auto", layout="contiguous"):
    _refuse_at_trace(schedule, q, k, v, group_size, causal, layout)
    b, h, s, _ = q.shape
    return q.new_empty(b, h, s, v.shape[-1]), q.new_empty(b, h, s, dtype=acc_dtype(q.dtype))


@torch.library.register_fake("commopt::cp_attention_bwd")
def _(dout, q, k, v, out, lse, schedule, causal, scale, group_size, group_name, backend="auto", layout="contiguous"):
    _refuse_at_trace(schedule, q, k, v, group_size, causal, layout)
    # contiguous, whatever the inputs' strides (the impl returns contiguous tensors)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class CPAttention(torch.autograd.Function):
    """out = attention(q, k, v) over the group, differentiable: the two ops in eager autograd."""

    @staticmethod
    def forward(ctx, q, k, v, schedule, causal, scale, group_size, group_name, backend, layout):
        out, lse = torch.ops.commopt.cp_attention_fwd(q, k, v, schedule, causal, scale, group_size, group_name, backend,
                                                      layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (schedule, causal, scale, group_size, group_name, backend, layout)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.commopt.cp_attention_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def cp_attention(q: Tensor, k: Tensor, v: Tensor, *, schedule: str = "ring", causal: bool = False,
                 scale: Optional[float] = None, group=None, backend: str = "auto", layout: str = "contiguous") -> Tensor:
    """Differentiable context-parallel attention of this rank's shards (shapes as
    cp_attention_fwd_op); group: a ProcessGroup, its name, or None for the default group;
    layout: how the program shards the sequence -- "contiguous", or "zigzag" (rank r holds
    chunks r and 2W-1-r of 2W: torch's context_parallel load balancing, head-tail), which
    ring_zigzag takes without relaying anything.  Under torch.compile pass a ProcessGroup or
    None: a name is resolved through c10d, which dynamo cannot trace (a graph break, an error
    with fullgraph=True)."""
    pg = schedules.as_group(group)
    return CPAttention.apply(q, k, v, str(CPSchedule.parse(schedule)), causal, scale, pg.size(), pg.group_name,
                             backend, layout)

