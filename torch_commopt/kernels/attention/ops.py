"""`torch.ops.commopt.cp_attention_fwd` / `cp_attention_bwd`, their training forms
`cp_attention_fwd_keep` / `cp_attention_bwd_kept` (schedules that move their inputs: the
forward keeps them moved, the backward moves dout alone), and `cp_attention` for eager use.

The ops name their group by string and carry its size (as the other commopt ops do), so the
fake impls can give exact shapes and refuse a schedule at trace time.  A graph pass inserts
the forward op into the forward graph and the backward op into the backward graph; eager code
and tests use `cp_attention`, an autograd.Function over the two.
"""

# Custom-op signatures are their schema; everything below them takes value types.  The ops'
# implementations and fake impls keep every argument the compiled graphs pass (exempt from the
# eight-parameter rule: tests/test_house_rules.py, CUSTOM_OPS); the schedules they call take
# Saved and CPOptions (kernels/attention/local.py, schedules.py).

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torch_commopt.core.attention_spec import CPSchedule, flex_hybrid_degrees, parse_flex_schedule
from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.attention import schedules
from torch_commopt.kernels.attention.local import Saved, acc_dtype
from torch_commopt.kernels.attention.schedules import CPOptions

# A fragment of the commopt namespace (kernels/matmul/ops.py holds its DEF library).  Plain
# torch.library.Library, as there: the ops need no autograd formula (cp_attention is the
# autograd wrapper) and custom_op's per-call wrappers would cost host time.
_LIB = torch.library.Library("commopt", "FRAGMENT")
_LIB.define("cp_attention_fwd(Tensor q, Tensor k, Tensor v, str schedule, bool causal, float? scale, "
            "int group_size, str group_name, str backend='auto', str layout='contiguous') -> (Tensor, Tensor)")
_LIB.define("cp_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str schedule, "
            "bool causal, float? scale, int group_size, str group_name, str backend='auto', "
            "str layout='contiguous') -> (Tensor, Tensor, Tensor)")
# The training forms of the schedules that move their inputs (schedules.moves_inputs): the
# forward keeps q, k, v, out, lse in its attention's layout and the backward takes them.
_LIB.define("cp_attention_fwd_keep(Tensor q, Tensor k, Tensor v, str schedule, bool causal, float? scale, "
            "int group_size, str group_name, str backend='auto') -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("cp_attention_bwd_kept(Tensor dout, Tensor q_kept, Tensor k_kept, Tensor v_kept, Tensor out_kept, "
            "Tensor lse_kept, str schedule, bool causal, float? scale, int group_size, str group_name, "
            "str backend='auto') -> (Tensor, Tensor, Tensor)")

# FlexAttention over a sequence-sharded Q, K and V (kernels/attention/flex.py): the block mask as its
# tables [kv_num, kv_idx, full_num, full_idx], [rows, keys, block size], the mask graph's code and
# its buffers; schedule "ring" or "allgather[:g=G]".  The backward takes the forward's out and lse.
_LIB.define("dense_block_tables(Tensor mask, int block) -> Tensor[]")
_LIB.define("cp_flex_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor?[] tables, Tensor[] buffers, str mask_code, "
            "int[] sizes, float scale, int group_size, str group_name, str schedule) -> (Tensor, Tensor)")
_LIB.define("cp_flex_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            "Tensor?[] tables, Tensor[] buffers, str mask_code, int[] sizes, float scale, int group_size, "
            "str group_name, str schedule) -> (Tensor, Tensor, Tensor)")
# The all-gather schedule of one head group keeping its gathered K/V for the backward, as the
# program's own all-gather does: the forward returns them too, the backward takes them for k and v.
_LIB.define("cp_flex_attention_fwd_keep(Tensor q, Tensor k, Tensor v, Tensor?[] tables, Tensor[] buffers, "
            "str mask_code, int[] sizes, float scale, int group_size, str group_name, str schedule) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("cp_flex_attention_bwd_kept(Tensor dout, Tensor q, Tensor k_all, Tensor v_all, Tensor out, Tensor lse, "
            "Tensor?[] tables, Tensor[] buffers, str mask_code, int[] sizes, float scale, int group_size, "
            "str group_name, str schedule) -> (Tensor, Tensor, Tensor)")

# Decoding attention over a KV cache sharded along the sequence (kernels/attention/decode.py):
# q replicated, k and v this rank's share, mask this rank's columns of the whole mask (or None).
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float? scale, int group_size, "
            "str group_name) -> Tensor")


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
                                          group=_group(group_size, group_name),
                                          options=CPOptions(backend=backend, layout=layout))
    return out.contiguous(), lse.contiguous()  # what the fake impl promises


def cp_attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, schedule: str,
                        causal: bool, scale: Optional[float], group_size: int, group_name: str,
                        backend: str = "auto", layout: str = "contiguous") -> tuple[Tensor, Tensor, Tensor]:
    """Context-parallel attention backward: dout, out (B, H, S_loc, Dv), lse (B, H, S_loc) of the
    forward; q, k, v as there.  Returns dq, dk, dv shaped and typed as q, k, v."""
    grads = schedules.cp_attention_bwd(dout, Saved(q, k, v, out, lse), schedule=schedule, causal=causal, scale=scale,
                                       group=_group(group_size, group_name),
                                       options=CPOptions(backend=backend, layout=layout))
    return tuple(g.contiguous() for g in grads)  # what the fake impl promises


def cp_attention_fwd_keep_op(q: Tensor, k: Tensor, v: Tensor, schedule: str, causal: bool, scale: Optional[float],
                             group_size: int, group_name: str, backend: str = "auto") -> tuple[Tensor, ...]:
    """The training forward of a schedule that moves its inputs (schedules.moves_inputs):
    out (B, H, S_loc, Dv) as cp_attention_fwd's, then q, k, v, out, lse as its attention saw
    them, each (G, B, h, S_m, ...) with head group g's at [g] (schedules.kept_shapes)."""
    out, kept = schedules.cp_attention_fwd_keep(q, k, v, schedule=schedule, causal=causal, scale=scale,
                                                group=_group(group_size, group_name),
                                                options=CPOptions(backend=backend))
    return (out.contiguous(), *kept)


def cp_attention_bwd_kept_op(dout: Tensor, q_kept: Tensor, k_kept: Tensor, v_kept: Tensor, out_kept: Tensor,
                             lse_kept: Tensor, schedule: str, causal: bool, scale: Optional[float], group_size: int,
                             group_name: str, backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """The backward of cp_attention_fwd_keep: dout (B, H, S_loc, Dv) and the kept tensors;
    returns dq, dk, dv in the sequence layout (B, H(_kv), S_loc, D)."""
    grads = schedules.cp_attention_bwd_kept(dout, (q_kept, k_kept, v_kept, out_kept, lse_kept), schedule=schedule,
                                            causal=causal, scale=scale, group=_group(group_size, group_name),
                                            options=CPOptions(backend=backend))
    return tuple(g.contiguous() for g in grads)


_LIB.impl("cp_attention_fwd", cp_attention_fwd_op, "CompositeExplicitAutograd")
_LIB.impl("cp_attention_bwd", cp_attention_bwd_op, "CompositeExplicitAutograd")
_LIB.impl("cp_attention_fwd_keep", cp_attention_fwd_keep_op, "CompositeExplicitAutograd")
_LIB.impl("cp_attention_bwd_kept", cp_attention_bwd_kept_op, "CompositeExplicitAutograd")


def _flex_blocks(tables, sizes, mask_code: str, buffers):
    from torch_commopt.kernels.attention import flex

    return flex.Blocks.from_tables(list(tables), list(sizes), mask_code, tuple(buffers))


def cp_flex_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, tables: list, buffers: list, mask_code: str,
                             sizes: list, scale: float, group_size: int, group_name: str,
                             schedule: str) -> tuple[Tensor, Tensor]:
    """(out in q's dtype, lse in the acc dtype) of this rank's rows over the whole sequence."""
    from torch_commopt.kernels.attention import flex_allgather, flex_hybrid, flex_ring

    name, groups = parse_flex_schedule(schedule)
    blocks, group = _flex_blocks(tables, sizes, mask_code, buffers), _group(group_size, group_name)
    if name == "ring":
        out, lse = flex_ring.ring_forward(q, k, v, blocks, scale, group)
    elif name == "hybrid":
        out, lse = flex_hybrid.hybrid_forward(q, k, v, blocks, scale, group, flex_hybrid_degrees(schedule))
    else:
        out, lse, _ = flex_allgather.allgather_forward(q, k, v, flex_allgather.Options(blocks, scale, group, groups))
    return out.to(q.dtype).contiguous(), lse.contiguous()


def cp_flex_attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, tables: list,
                             buffers: list, mask_code: str, sizes: list, scale: float, group_size: int,
                             group_name: str, schedule: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares."""
    from torch_commopt.kernels.attention import flex_allgather, flex_hybrid, flex_ring

    name, groups = parse_flex_schedule(schedule)
    blocks, group = _flex_blocks(tables, sizes, mask_code, buffers), _group(group_size, group_name)
    if name == "ring":
        grads = flex_ring.ring_backward(flex_ring.Saved(q, k, v, out, lse), dout.contiguous(), blocks, scale, group)
    elif name == "hybrid":
        grads = flex_hybrid.hybrid_backward(flex_ring.Saved(q, k, v, out, lse), dout.contiguous(), blocks, scale,
                                            group, flex_hybrid_degrees(schedule))
    else:
        grads = flex_allgather.allgather_backward((q, k, v, out, lse), dout.contiguous(),
                                                  flex_allgather.Options(blocks, scale, group, groups))
    return tuple(g.contiguous() for g in grads)


def _kept_schedule(schedule: str) -> int:
    """The head groups of a schedule the kept pair runs: the all-gather of one group only."""
    name, groups = parse_flex_schedule(schedule)
    if name != "allgather" or groups != 1:
        raise ValueError(f"commopt cp_flex_attention keep: the all-gather of one head group keeps its K/V, "
                         f"not {schedule!r}")
    return groups


def cp_flex_attention_fwd_keep_op(q: Tensor, k: Tensor, v: Tensor, tables: list, buffers: list, mask_code: str,
                                  sizes: list, scale: float, group_size: int, group_name: str,
                                  schedule: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, K, V): cp_flex_attention_fwd's out and lse, and the whole sequence's gathered K and V."""
    from torch_commopt.kernels.attention import flex_allgather

    groups = _kept_schedule(schedule)  # one head group: allgather_forward keeps its K/V
    opts = flex_allgather.Options(_flex_blocks(tables, sizes, mask_code, buffers), scale,
                                  _group(group_size, group_name), groups)
    out, lse, (k_all, v_all) = flex_allgather.allgather_forward(q, k, v, opts, keep=True)
    return out.to(q.dtype).contiguous(), lse.contiguous(), k_all, v_all


def cp_flex_attention_bwd_kept_op(dout: Tensor, q: Tensor, k_all: Tensor, v_all: Tensor, out: Tensor, lse: Tensor,
                                  tables: list, buffers: list, mask_code: str, sizes: list, scale: float,
                                  group_size: int, group_name: str, schedule: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares from the forward's gathered K and V (nothing gathered)."""
    from torch_commopt.kernels.attention import flex_allgather

    groups, group = _kept_schedule(schedule), _group(group_size, group_name)
    opts = flex_allgather.Options(_flex_blocks(tables, sizes, mask_code, buffers), scale, group, groups)
    share = k_all.shape[2] // group_size
    k, v = (t.narrow(2, 0, share) for t in (k_all, v_all))  # a share's shape and dtype (not read)
    grads = flex_allgather.allgather_backward((q, k, v, out, lse), dout.contiguous(), opts, (k_all, v_all))
    return tuple(g.contiguous() for g in grads)


def dense_block_tables_op(mask: Tensor, block: int) -> list[Tensor]:
    """[kv_num, kv_idx, full_num, full_idx] of a dense boolean mask (flex.dense_tables)."""
    from torch_commopt.kernels.attention import flex

    return flex.dense_tables(mask, block)


_LIB.impl("dense_block_tables", dense_block_tables_op, "CompositeExplicitAutograd")
_LIB.impl("cp_flex_attention_fwd", cp_flex_attention_fwd_op, "CompositeExplicitAutograd")
_LIB.impl("cp_flex_attention_bwd", cp_flex_attention_bwd_op, "CompositeExplicitAutograd")
_LIB.impl("cp_flex_attention_fwd_keep", cp_flex_attention_fwd_keep_op, "CompositeExplicitAutograd")
_LIB.impl("cp_flex_attention_bwd_kept", cp_flex_attention_bwd_kept_op, "CompositeExplicitAutograd")


def _fake_out_lse(q, v) -> tuple:
    """The flex forwards' out (q's rows, v's head dim, q's dtype) and lse (the acc dtype)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=acc)


@torch.library.register_fake("commopt::cp_flex_attention_fwd")
def _(q, k, v, tables, buffers, mask_code, sizes, scale, group_size, group_name, schedule):
    parse_flex_schedule(schedule)
    return _fake_out_lse(q, v)


@torch.library.register_fake("commopt::dense_block_tables")
def _(mask, block):
    rows, keys = mask.shape[-2] // block, mask.shape[-1] // block
    lead = tuple(mask.shape[:-2])
    num, idx = (lead + (rows,), lead + (rows, keys))
    return [mask.new_empty(s, dtype=torch.int32) for s in (num, idx, num, idx)]


@torch.library.register_fake("commopt::cp_flex_attention_bwd")
def _(dout, q, k, v, out, lse, tables, buffers, mask_code, sizes, scale, group_size, group_name, schedule):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op gives them


@torch.library.register_fake("commopt::cp_flex_attention_fwd_keep")
def _(q, k, v, tables, buffers, mask_code, sizes, scale, group_size, group_name, schedule):
    _kept_schedule(schedule)
    gathered = [t.new_empty(t.shape[:2] + (t.shape[2] * group_size,) + t.shape[3:]) for t in (k, v)]
    return (*_fake_out_lse(q, v), *gathered)


@torch.library.register_fake("commopt::cp_flex_attention_bwd_kept")
def _(dout, q, k_all, v_all, out, lse, tables, buffers, mask_code, sizes, scale, group_size, group_name, schedule):
    share = lambda t: t.new_empty(t.shape[:2] + (t.shape[2] // group_size,) + t.shape[3:])  # noqa: E731
    return q.new_empty(q.shape), share(k_all), share(v_all)


def decode_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: Optional[float],
                        group_size: int, group_name: str) -> Tensor:
    """The attention of the replicated queries q (B, H, S_q, D) over the whole sequence-sharded
    cache, this rank's share k (B, H_kv, S_loc, D), v (B, H_kv, S_loc, Dv): (B, H, S_q, Dv) in q's
    dtype, the same on every rank."""
    from torch_commopt.kernels.attention.decode import decode_attention

    return decode_attention(q, k, v, mask, scale, _group(group_size, group_name)).contiguous()


_LIB.impl("decode_attention", decode_attention_op, "CompositeExplicitAutograd")


@torch.library.register_fake("commopt::decode_attention")
def _(q, k, v, mask, scale, group_size, group_name):
    b, h, s, _ = q.shape
    return q.new_empty(b, h, s, v.shape[-1])


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


@torch.library.register_fake("commopt::cp_attention_fwd_keep")
def _(q, k, v, schedule, causal, scale, group_size, group_name, backend="auto"):
    _refuse_at_trace(schedule, q, k, v, group_size, causal, "contiguous")
    if not schedules.moves_inputs(schedule, group_size, causal):
        raise ValueError(f"cp_attention_fwd_keep: {schedule} moves no inputs (causal={causal})")
    b, h, s, _ = q.shape
    kept = [q.new_empty(shape, dtype=dtype) for shape, dtype in schedules.kept_shapes(schedule, q, k, v, group_size)]
    return (q.new_empty(b, h, s, v.shape[-1]), *kept)


@torch.library.register_fake("commopt::cp_attention_bwd_kept")
def _(dout, q_kept, k_kept, v_kept, out_kept, lse_kept, schedule, causal, scale, group_size, group_name, backend="auto"):
    shapes = schedules.check_kept(CPSchedule.parse(schedule), dout, (q_kept, k_kept, v_kept, out_kept, lse_kept),
                                  group_size, causal)
    return tuple(x.new_empty(shape) for x, shape in zip((q_kept, k_kept, v_kept), shapes))


_DEFAULT_OPTIONS = CPOptions()


class CPAttention(torch.autograd.Function):
    """out = attention(q, k, v) over the group, differentiable: the two ops in eager autograd."""

    @staticmethod
    def forward(ctx, q, k, v, op_args: tuple, layout):
        """op_args: the ops' arguments after the tensors, in their schemas' order (schedule,
        causal, scale, group_size, group_name, backend); layout: the sequence layout."""
        schedule, causal, _, group_size, _, _ = op_args
        # a schedule that moves its inputs keeps them moved for the backward (when there is one)
        ctx.kept = any(ctx.needs_input_grad[:3]) and schedules.moves_inputs(schedule, group_size, causal, layout)
        ctx.args = op_args
        if ctx.kept:
            out, *kept = torch.ops.commopt.cp_attention_fwd_keep(q, k, v, *ctx.args)
            ctx.save_for_backward(*kept)
            return out
        out, lse = torch.ops.commopt.cp_attention_fwd(q, k, v, *ctx.args, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.kept:
            dq, dk, dv = torch.ops.commopt.cp_attention_bwd_kept(dout.contiguous(), *ctx.saved_tensors, *ctx.args)
        else:
            dq, dk, dv = torch.ops.commopt.cp_attention_bwd(dout.contiguous(), *ctx.saved_tensors, *ctx.args,
                                                            ctx.layout)
        return dq, dk, dv, None, None


def cp_attention(q: Tensor, k: Tensor, v: Tensor, *, schedule: str = "ring", causal: bool = False,
                 scale: Optional[float] = None, group=None, options: CPOptions = _DEFAULT_OPTIONS) -> Tensor:
    """Differentiable context-parallel attention of this rank's shards (shapes as
    cp_attention_fwd_op); group: a ProcessGroup, its name, or None for the default group;
    options (CPOptions): the local kernel (backend) and how the program shards the sequence
    (layout) -- "contiguous", or "zigzag" (rank r holds chunks r and 2W-1-r of 2W: torch's
    context_parallel load balancing, head-tail), which ring_zigzag takes without relaying
    anything; the head groups are the schedule's (g=G), not options.head_groups.  Under
    torch.compile pass a ProcessGroup or None: a name is resolved through c10d, which dynamo
    cannot trace (a graph break, an error with fullgraph=True)."""
    if options.head_groups is not None:
        raise ValueError("cp_attention: CPOptions.head_groups is for the schedules' entries; name the head groups "
                         "in the schedule (e.g. 'ulysses:g=2')")
    pg = schedules.as_group(group)
    op_args = (str(CPSchedule.parse(schedule)), causal, scale, pg.size(), pg.group_name, options.backend)
    return CPAttention.apply(q, k, v, op_args, options.layout)

