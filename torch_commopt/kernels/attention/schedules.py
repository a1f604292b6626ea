"""Context-parallel attention over a process group: forward and backward of every schedule.

Inputs are this rank's shards of the program's contiguous layout (rank r holds tokens
[r*S_loc, (r+1)*S_loc) of the sequence dim 2):

    q: (B, H, S_loc, D), k: (B, H_kv, S_loc, D), v: (B, H_kv, S_loc, Dv); H_kv divides H.

Forward returns out (B, H, S_loc, Dv) in q's dtype and lse (B, H, S_loc) in float32 (float64
for a float64 run); backward takes them back, with dout, and returns dq, dk, dv in the inputs'
dtypes.  The two are separate calls, so a graph pass can place them in the forward and the
backward graphs.  Schedules (spec.py):

    allgather    all-gather K/V (one collective of K and V together), attention of the local
                 queries against the keys up to this rank's (causal: the earlier ranks' keys in
                 full, its own block causal).  Backward gathers again and reduce-scatters dK/dV
                 in fp32.
    ring         ring.py on the contiguous layout.
    ring_zigzag  causal load balance.  The program's layout is contiguous, so the op permutes:
                 one all-to-all moves q, k, v to the zigzag layout (rank r: chunks r and
                 2W-1-r of 2W) and one moves out, lse back; the backward moves dout, q, k, v,
                 out, lse there and dq, dk, dv back.  About one local q+k+v (+out) of extra
                 traffic per call, on top of the ring's (W-1) K/V shifts: worth it where the
                 causal ring's imbalance (rank W-1 does ~2x the average work) costs more.
                 Large shards pipeline the relayouts over two head groups (spec.
                 zigzag_head_groups, or the schedule's g=G; _pipelined): group 2's inputs travel while group 1's ring
                 computes, group 1's results while group 2's does.
                 Relaying the query side only (ring.zigzag_q_plan: K/V stay contiguous, half
                 the bytes) is not taken: its smaller blocks cost 12% more
                 compute at 8K tokens/GPU on an H200, more than the bytes it saves.
                 Without causal there is nothing to balance: it runs ring, no exchange.
                 A program already in zigzag layout can call ring.ring_fwd with zigzag_plan.
    ulysses      all-to-all sequence -> heads (q, k, v together), full-sequence attention on
                 H/W heads, all-to-all back (out and lse together); for large shards
                 pipelined over two head groups (spec.ulysses_head_groups, or g=G).  On CUDA the
                 all-to-alls go by the copy engine straight into the attention's layout
                 (ce_a2a.py), elsewhere by comm.exchange (NCCL or gloo).
    ulysses:early  ulysses whose forward attention starts on the rank's own sequence block
                 while the peers' blocks arrive, runs the rest block by block and sends each
                 result piece back as soon as it is final (own_first.py); its backward is
                 ulysses's (one attention call: split, cuDNN's backward costs more than it hides).
    hybrid:U:R   Ulysses over U consecutive ranks, then a contiguous ring over R of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.core.attention_spec import AttentionShape, CPSchedule, pipeline_groups, refusal
from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.attention import ce_a2a, comm, own_first
from torch_commopt.kernels.attention.lane import Lane
from torch_commopt.kernels.attention.local import Saved, acc_dtype, attend_bwd, attend_fwd, default_scale
from torch_commopt.kernels.attention.merge import Accumulator
from torch_commopt.kernels.attention.ring import contiguous_plan, ring_bwd, ring_fwd, zigzag_plan
from torch_commopt.kernels.collectives import all_gather, reduce_scatter

GroupLike = Union[dist.ProcessGroup, str, None]


def as_group(group: GroupLike) -> dist.ProcessGroup:
    """A process group from a group, its name, or None (the default group)."""
    if group is None:
        return dist.group.WORLD
    return resolve_group(group) if isinstance(group, str) else group


# How the program shards the sequence: rank r holds chunk r of W ("contiguous"), or chunks r and
# 2W-1-r of 2W ("zigzag": torch context_parallel's head-tail load balancing).
SEQUENCE_LAYOUTS = ("contiguous", "zigzag")


@dataclass(kw_only=True, frozen=True)
class CPOptions:
    """The knobs of a context-parallel attention call beside its schedule, mask, scale and group,
    rarely changed.

    backend: the local attention kernel (local.py: "auto", "math", ...).
    layout: how the program shards the sequence (SEQUENCE_LAYOUTS): "contiguous", or "zigzag"
        (rank r holds chunks r and 2W-1-r of 2W: torch's context_parallel load balancing); the
        training forms (cp_attention_fwd_keep / cp_attention_bwd_kept) take "contiguous" only.
    head_groups: the relayout pipeline's depth (None: the schedule's g=G, else the rule's,
        spec.pipeline_groups); the schedules' entries here only: the ops and cp_attention take
        the schedule's g=G.
    """

    backend: str = "auto"
    layout: str = "contiguous"
    head_groups: Optional[int] = None


_DEFAULT_OPTIONS = CPOptions()


class _Route(NamedTuple):
    """How a ring-based call's tensors travel (_route): its schedule, mask and group; the ring's
    plan and group, and the Ulysses group its heads are moved over (None where nothing moves
    heads)."""

    sched: CPSchedule
    causal: bool
    pg: dist.ProcessGroup
    plan: object
    ring: object
    ulysses: object


def check(sched: CPSchedule, q: Tensor, k: Tensor, v: Tensor, world: int, causal: bool,
          layout: str = "contiguous") -> None:
    """Raise ValueError where the schedule cannot take these shards.  A zigzag-sharded causal
    sequence is taken by ring_zigzag only (the other schedules' masks assume rank order);
    without a mask any schedule takes any layout (the keys' order does not matter)."""
    if layout not in SEQUENCE_LAYOUTS:
        raise ValueError(f"cp attention: layout must be one of {SEQUENCE_LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and causal and sched.name != "ring_zigzag":
        raise ValueError(f"cp attention {sched}: a causal zigzag-sharded sequence needs ring_zigzag "
                         "(the other schedules' causal masks assume the contiguous layout)")
    if q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"cp attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
                         "(B, H, S_loc, D), (B, H_kv, S_loc, D), (B, H_kv, S_loc, Dv)")
    b, h, s, d = q.shape
    reason = refusal(sched, AttentionShape(b, h, k.shape[1], s * world, d), world, causal)
    if reason is not None:
        raise ValueError(f"cp attention {sched}: {reason}")


def cp_attention_fwd(q: Tensor, k: Tensor, v: Tensor, *, schedule: Union[str, CPSchedule], causal: bool,
                     scale: Optional[float] = None, group: GroupLike = None,
                     options: CPOptions = _DEFAULT_OPTIONS) -> tuple[Tensor, Tensor]:
    """Context-parallel attention forward.  Shapes in the module docstring; options: the local
    kernel, the sequence layout and the relayout pipeline's depth (CPOptions).  Returns (out, lse)."""
    backend, layout = options.backend, options.layout
    pg, sched = as_group(group), CPSchedule.parse(schedule)
    check(sched, q, k, v, pg.size(), causal, layout)
    scale = default_scale(q.shape[-1], scale)
    if layout == "zigzag" and causal:  # already balanced: the ring runs on the shards as they are
        return ring_fwd(q, k, v, scale=scale, plan=zigzag_plan(True), group=pg, backend=backend)
    if sched.name == "allgather":
        return _allgather_fwd(q, k, v, causal, scale, pg, backend)
    route = _route(sched, pg, causal)

    def attend(*moved):
        return ring_fwd(*moved, scale=scale, plan=route.plan, group=route.ring, backend=backend)
    outs = [(q.shape[:3] + v.shape[3:], q.dtype), (q.shape[:3], acc_dtype(q.dtype))]
    compute = _early(sched, route.ulysses, causal, scale, backend) or attend
    return _moved(route, [q, k, v], compute, _groups(sched, q, k, pg.size(), options.head_groups), outs)


def cp_attention_bwd(dout: Tensor, saved: Saved, *, schedule: Union[str, CPSchedule], causal: bool,
                     scale: Optional[float] = None, group: GroupLike = None,
                     options: CPOptions = _DEFAULT_OPTIONS) -> tuple[Tensor, Tensor, Tensor]:
    """Context-parallel attention backward, given saved = (q, k, v, out, lse) of the forward
    (out, lse global: merged over all K/V).  dout, out: (B, H, S_loc, Dv); lse: (B, H, S_loc).
    Returns (dq, dk, dv)."""
    q, k, v, out, lse = saved
    backend, layout = options.backend, options.layout
    pg, sched = as_group(group), CPSchedule.parse(schedule)
    check(sched, q, k, v, pg.size(), causal, layout)
    scale = default_scale(q.shape[-1], scale)
    if layout == "zigzag" and causal:
        return ring_bwd(dout, Saved(q, k, v, out, lse), scale=scale, plan=zigzag_plan(True), group=pg, backend=backend)
    if sched.name == "allgather":
        return _allgather_bwd(dout, Saved(q, k, v, out, lse), causal, scale, pg, backend)
    route = _route(sched, pg, causal)

    def attend(dout_m, *saved_m):
        return ring_bwd(dout_m, Saved(*saved_m), scale=scale, plan=route.plan, group=route.ring, backend=backend)
    outs = [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)]
    return _moved(route, [dout, q, k, v, out, lse], attend, _groups(sched, q, k, pg.size(), options.head_groups),
                  outs, backward=True)


# ---- the training forms of the schedules that move their inputs ------------------------------
# Ulysses (and a hybrid) runs its attention on head shards of the whole sequence, ring_zigzag on
# the zigzag chunks.  A backward given the sequence-layout q, k, v, out, lse moves all five there
# again beside dout (what cp_attention_bwd does); the program's own Ulysses keeps the moved
# tensors instead and moves dout alone.  So do these: the forward keeps q, k, v, out, lse in the
# layout its attention ran in -- the same bytes as the sequence-layout tensors a plain forward's
# backward would keep -- and the backward takes them.

KEPT = ("q", "k", "v", "out", "lse")


def moves_inputs(schedule: Union[str, CPSchedule], world: int, causal: bool, layout: str = "contiguous") -> bool:
    """Whether `schedule` moves q, k, v to another layout before its attention (Ulysses's
    heads with U > 1; ring_zigzag's chunks, causal, on a contiguous program): the schedules
    that have a training form (cp_attention_fwd_keep / cp_attention_bwd_kept)."""
    sched = CPSchedule.parse(schedule)
    if layout == "zigzag" and causal:
        return False
    if sched.name == "ring_zigzag":
        return causal
    return sched.name in ("ulysses", "hybrid") and sched.degrees(world)[0] > 1


def kept_shapes(schedule: Union[str, CPSchedule], q, k, v, world: int, head_groups: Optional[int] = None) -> list:
    """(shape, dtype) of each kept tensor (KEPT) for shards q, k, v (tensors or fakes) of a
    schedule that moves them: (G, B, h, S_m, D) -- head group g's at [g], h its heads on this
    rank, S_m the sequence it attended over (Ulysses: n * S_loc over n ranks; zigzag: S_loc
    in chunk order) -- and the lse (G, B, h_q, S_m) in float32 (float64 for float64 q)."""
    sched = CPSchedule.parse(schedule)
    (b, h, s, d), h_kv, dv = q.shape, k.shape[1], v.shape[3]
    n = _spread(sched, world)
    groups = _groups(sched, q, k, world, head_groups)
    hq, hk, sm = h // (groups * n), h_kv // (groups * n), s * n
    return [((groups, b, hq, sm, d), q.dtype), ((groups, b, hk, sm, d), k.dtype), ((groups, b, hk, sm, dv), v.dtype),
            ((groups, b, hq, sm, dv), q.dtype), ((groups, b, hq, sm), acc_dtype(q.dtype))]


def unkept_shapes(schedule: Union[str, CPSchedule], q_m, k_m, v_m, world: int) -> list[tuple]:
    """The sequence-layout shapes of q, k, v (dq, dk, dv) from their kept tensors."""
    n = _spread(CPSchedule.parse(schedule), world)

    def seq(x):
        groups, b, h, sm, d = x.shape
        return (b, groups * n * h, sm // n, d)
    return [seq(q_m), seq(k_m), seq(v_m)]


def cp_attention_fwd_keep(q: Tensor, k: Tensor, v: Tensor, *, schedule: Union[str, CPSchedule], causal: bool,
                          scale: Optional[float] = None, group: GroupLike = None,
                          options: CPOptions = _DEFAULT_OPTIONS) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The training forward of a schedule that moves its inputs (moves_inputs; contiguous
    program layout): out (B, H, S_loc, Dv) as cp_attention_fwd's, and the kept q, k, v, out,
    lse (kept_shapes) for cp_attention_bwd_kept.  The lse is not moved back."""
    backend, head_groups = options.backend, options.head_groups
    _contiguous_only(options)
    pg, sched = as_group(group), CPSchedule.parse(schedule)
    check(sched, q, k, v, pg.size(), causal)
    if not moves_inputs(sched, pg.size(), causal):
        raise ValueError(f"cp attention {sched}: moves no inputs here (causal={causal}); use cp_attention_fwd")
    scale = default_scale(q.shape[-1], scale)
    kept = [torch.empty(shape, dtype=dt, device=q.device) for shape, dt in
            kept_shapes(sched, q, k, v, pg.size(), head_groups)]
    groups, step = kept[0].shape[0], iter(range(kept[0].shape[0]))
    route = _route(sched, pg, causal)

    def attend(*moved):
        out_h, lse_h = ring_fwd(*moved, scale=scale, plan=route.plan, group=route.ring, backend=backend)
        kept[4][next(step)].copy_(lse_h)
        return (out_h,)
    compute = _early(sched, route.ulysses, causal, scale, backend, kept[4]) or attend
    (out,) = _moved(route, [q, k, v], compute, groups, [(q.shape[:3] + v.shape[3:], q.dtype)], kept[:3], kept[3:4])
    return out, tuple(kept)


def cp_attention_bwd_kept(dout: Tensor, kept: tuple[Tensor, ...], *, schedule: Union[str, CPSchedule], causal: bool,
                          scale: Optional[float] = None, group: GroupLike = None,
                          options: CPOptions = _DEFAULT_OPTIONS) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of cp_attention_fwd_keep: dout (B, H, S_loc, Dv) and its kept tensors.
    Only dout moves to the attention's layout (head group by head group, as the forward's
    groups); returns dq, dk, dv in the sequence layout, typed as q, k, v.  options: its
    backend (the head groups are the kept tensors')."""
    backend = options.backend
    _contiguous_only(options)
    pg, sched = as_group(group), CPSchedule.parse(schedule)
    shapes = check_kept(sched, dout, kept, pg.size(), causal)
    q_m, k_m, v_m, out_m, lse_m = kept
    scale = default_scale(q_m.shape[-1], scale)
    groups, step = q_m.shape[0], iter(range(q_m.shape[0]))
    route = _route(sched, pg, causal)

    def attend(dout_h):
        g = next(step)
        return ring_bwd(dout_h, Saved(q_m[g], k_m[g], v_m[g], out_m[g], lse_m[g]), scale=scale, plan=route.plan,
                        group=route.ring, backend=backend)
    outs = [(shape, t.dtype) for shape, t in zip(shapes, (q_m, k_m, v_m))]
    return _moved(route, [dout], attend, groups, outs, backward=True)


def _contiguous_only(options: CPOptions) -> None:
    """The training forms run on a contiguous program layout (a zigzag one moves nothing)."""
    if options.layout != "contiguous":
        raise ValueError(f"cp attention: the training forms take the contiguous layout, got CPOptions.layout="
                         f"{options.layout!r} (use cp_attention_fwd / cp_attention_bwd)")


def check_kept(sched: CPSchedule, dout, kept, world: int, causal: bool) -> list[tuple]:
    """The sequence-layout shapes of dq, dk, dv (unkept_shapes) for dout and the kept tensors of
    cp_attention_fwd_keep (tensors or fakes); a clear error where they do not fit the schedule
    (wrong count, shapes that disagree with each other or with dout, a schedule that keeps
    nothing)."""
    if len(kept) != len(KEPT):
        raise ValueError(f"cp attention {sched}: want the kept {KEPT}, got {len(kept)} tensors")
    got = [tuple(t.shape) for t in kept]
    if any(len(x) != 5 for x in got[:4]) or len(got[4]) != 4:
        raise ValueError(f"cp attention {sched}: kept {got} are not (G, B, h, S_m, D) x 4 and (G, B, h, S_m)")
    q_m, k_m, v_m, out_m, lse_m = kept
    shapes = unkept_shapes(sched, q_m, k_m, v_m, world)
    reason = refusal(sched, AttentionShape(shapes[0][0], shapes[0][1], shapes[1][1], shapes[0][2] * world,
                                           shapes[0][3]), world, causal)
    agree = (got[3] == got[0][:4] + (got[2][4],) and got[4] == got[0][:4] and got[1] == got[2][:4] + (got[1][4],)
             and got[1][:2] == got[0][:2] and got[1][3] == got[0][3])
    if reason is not None or not moves_inputs(sched, world, causal) or not agree or \
            tuple(dout.shape) != shapes[0][:3] + (got[2][4],):
        raise ValueError(f"cp attention {sched}: dout {tuple(dout.shape)} and kept {got} do not fit "
                         f"({reason or 'the shapes disagree, or the schedule keeps nothing'})")
    return shapes


def _early(sched: CPSchedule, ugroup, causal: bool, scale: float, backend: str, kept_lse=None):
    """ulysses:early's staged forward compute (own_first.Forward), None for other schedules."""
    if not sched.early:
        return None
    return own_first.Forward(me=comm.rank(ugroup), n=comm.size(ugroup), causal=causal, scale=scale, backend=backend,
                             kept_lse=kept_lse)


def _spread(sched: CPSchedule, world: int) -> int:
    """The ranks a head group's heads are split over where the schedule moves them: the
    Ulysses degree (ring_zigzag moves sequence chunks, not heads: 1)."""
    return 1 if sched.name == "ring_zigzag" else sched.degrees(world)[0]


def _route(sched: CPSchedule, pg: dist.ProcessGroup, causal: bool) -> _Route:
    """The ring plan, ring group and Ulysses group of a ring-based schedule on a contiguous
    program: causal ring_zigzag's ring over the whole group on the zigzag chunks, else the
    hybrid's two sub-groups (ring: a Ulysses group of one; ulysses: a ring of one; ring_zigzag
    without a mask: ring)."""
    if sched.name == "ring_zigzag" and causal:
        return _Route(sched, causal, pg, zigzag_plan(True), pg, None)
    ugroup, rgroup = comm.hybrid_groups(pg, *sched.degrees(pg.size()))
    return _Route(sched, causal, pg, contiguous_plan(causal), rgroup, ugroup)


def _moved(route: _Route, xs, attend, groups: int, outs, keep_in=None, keep_out=None, backward: bool = False):
    """attend per head group, its inputs moved there and its results back: causal ring_zigzag's
    relayouts, else Ulysses's all-to-alls over route.ulysses (none for a Ulysses group of one;
    outs: the results' sequence-layout specs).  route.ring: attend's own ring (None: a ring of
    one, which moves nothing, so its head groups may run concurrently where ce_a2a's group
    streams are asked for this pass -- both passes' by default; `backward` says which pass
    this is)."""
    if route.sched.name == "ring_zigzag" and route.causal:
        return _zigzag_pipelined(xs, attend, route.pg, groups, keep_in, keep_out)
    return _ulysses_pipelined(xs, attend, route.ulysses, groups, outs, keep_in, keep_out,
                              concurrent=comm.size(route.ring) == 1 and ce_a2a.group_streams_asked(backward))


def _groups(sched: CPSchedule, q, k, world: int, head_groups: Optional[int]) -> int:
    """The head groups a call pipelines over: head_groups if given, else the schedule's g=G,
    else the rule's (spec.pipeline_groups)."""
    return head_groups or pipeline_groups(sched, q.numel() * q.element_size(), q.shape[1], k.shape[1], world)


def _zigzag_pipelined(xs: list[Tensor], ring, group: dist.ProcessGroup, groups: int, keep_in=None, keep_out=None):
    """ring(*zigzag xs) per head group, its inputs relaid to the zigzag layout and its results
    back to the contiguous one (_pipelined; keep_in / keep_out as there)."""
    def there(parts, async_op):
        return comm.relayout(parts, group, comm.contiguous_chunks, comm.zigzag_chunks, async_op=async_op)

    def back(results, async_op, out):
        return comm.relayout(results, group, comm.zigzag_chunks, comm.contiguous_chunks, async_op=async_op, out=out)
    return _pipelined("ring_zigzag", xs, ring, _Moves(there, back, lambda shape: shape), groups, keep_in, keep_out)


def _ulysses_pipelined(xs: list[Tensor], ring, ugroup, groups: int, outs, keep_in=None, keep_out=None,
                       concurrent: bool = False):
    """ring(*head-sharded xs) per head group (ulysses: a ring of one rank, i.e. the local
    attention over the whole sequence; hybrid: a ring over the ring group), its inputs moved
    sequence -> heads and its results heads -> sequence over the Ulysses group: by the copy
    engine where ce_a2a can (CUDA), else by comm's all-to-alls (_pipelined).  Group g takes
    heads [g*h/G, (g+1)*h/G) of every tensor, which the all-to-all splits again over the n
    Ulysses ranks, so every query head keeps its K/V head.  outs: the results' (shape, dtype)
    in the sequence layout; groups: G (_groups); keep_in / keep_out as _pipelined's;
    concurrent: ring makes no collective calls (ce_a2a.pipelined)."""
    n = comm.size(ugroup)
    if n == 1:  # the ring schedule (hybrid:1:W): nothing moves
        return tuple(ring(*xs))
    if any(x.shape[1] % (groups * n) for x in xs):
        raise ValueError(f"cp attention ulysses: {groups} head groups of {n} ranks do not divide the heads "
                         f"{[x.shape[1] for x in xs]}")
    if ce_a2a.usable(xs, ugroup, groups, outs):
        from torch_commopt.kernels.gpu.symm import SymmAllocError

        try:
            return ce_a2a.pipelined(xs, ring, ugroup, groups, outs, keep_in, keep_out, concurrent=concurrent)
        except SymmAllocError as e:  # on every rank of the group together, before anything moved
            comm.refused_once(f"commopt attention: {e}; the Ulysses all-to-alls run on NCCL")

    def there(parts, async_op):
        return comm.seq_to_heads(parts, ugroup, async_op=async_op)

    def back(results, async_op, out):
        return comm.heads_to_seq(results, ugroup, async_op=async_op, out=out)

    def shape(s):
        return (s[0], n * s[1], s[2] // n) + tuple(s[3:])
    return _pipelined("ulysses", xs, ring, _Moves(there, back, shape, comm.rank(ugroup), n), groups, keep_in, keep_out)


class _Moves(NamedTuple):
    """How _pipelined moves a head group: there(parts, async_op) its inputs to the attention's
    layout, back(results, async_op, out) its results back into `out`; back_shape: a result's
    shape after the move back; me, n: this rank's place among the n ranks a head group's heads
    are split over (the own pieces a staged compute starts on)."""

    there: Callable
    back: Callable
    back_shape: Callable
    me: int = 0
    n: int = 1


def _pipelined(name: str, xs: list[Tensor], compute, moves: _Moves, groups: int, keep_in=None, keep_out=None):
    """compute(*moved xs) per head group, pipelined: group g+1's inputs are moved (there) while
    group g computes, and group g's results move back while group g+1 computes, so only the
    first group's inputs and the last group's results are exposed.  The moves run on a side
    stream on CUDA (lane.Lane: their packing copies overlap the compute too).  Group g takes
    heads [g*h/G, (g+1)*h/G) of every x (h its own head count: H for q-side tensors, H_kv for
    K/V), so every query head keeps its K/V head (GQA: head i reads kv head i // (H/H_kv));
    each group's results are written into their head slice of the outputs (no concatenation).
    compute is called once per group, in group order.
    moves: how a group's tensors move there and back (_Moves).  keep_in / keep_out (cp_attention_fwd_keep): tensors
    (G, ...) that receive group g's moved inputs / its results at [g] (None: not kept).
    compute may be staged (own_first.Forward; Ulysses only): early(g, own) on this
    rank's own pieces (rank `me` of the n it splits heads over) before the moved inputs are
    waited for, then rest(g, moved), whose pieces are put together into whole results here."""
    there, back, back_shape, me, n = moves
    if groups < 1 or any(x.shape[1] % groups for x in xs):
        raise ValueError(f"cp attention {name}: {groups} head groups do not divide the heads {[x.shape[1] for x in xs]}")
    lane = Lane(xs[0].device)

    def part(x: Tensor, g: int) -> Tensor:
        h = x.shape[1] // groups
        return x[:, g * h:(g + 1) * h]

    def own(g: int) -> list[Tensor]:
        pieces = []
        for x in xs:
            hd = x.shape[1] // (groups * n)  # heads per rank in a group
            pieces.append(part(x, g)[:, me * hd:(me + 1) * hd])
        return pieces

    def inbound(g: int):
        parts = [part(x, g) for x in xs]
        return lane.move(lambda async_op: there(parts, async_op), parts)
    staged = hasattr(compute, "rest")
    pending, outs, backs = inbound(0), None, []
    for g in range(groups):
        if staged:  # the own block's attention before the wait for the moved inputs
            compute.early(g, own(g))
        moved = pending()
        if g + 1 < groups:
            pending = inbound(g + 1)
        for dst, x in zip(keep_in or (), moved):
            dst[g].copy_(x)
        results = _assembled(compute.rest(g, moved), moved[0].shape[2]) if staged else list(compute(*moved))
        del moved
        for dst, r in zip(keep_out or (), results):
            dst[g].copy_(r)
        if outs is None:
            outs = []
            for r in results:
                full = list(back_shape(tuple(r.shape)))
                full[1] *= groups
                outs.append(torch.empty(full, dtype=r.dtype, device=r.device))
        dst = [part(o, g) for o in outs]
        backs.append(lane.move(lambda async_op, res=results, dst=dst: back(res, async_op, dst), results))
    for finish in backs:
        finish()
    return tuple(outs)


def _assembled(batches, seq: int) -> list[Tensor]:
    """A staged compute's pieces (result index, destination rank, its token block) put together
    into whole [B, h, seq, tail] results; every block of every result must come exactly once."""
    results: dict[int, Tensor] = {}
    seen: set[tuple[int, int]] = set()
    length = seq
    for pieces in batches:
        for i, d, piece in pieces:
            length = piece.shape[2]
            if i not in results:
                results[i] = piece.new_empty(tuple(piece.shape[:2]) + (seq,) + tuple(piece.shape[3:]))
            if (i, d) in seen or (d + 1) * length > seq:
                raise RuntimeError(f"cp attention: staged compute gave piece ({i}, {d}) twice or out of range")
            seen.add((i, d))
            results[i][:, :, d * length:(d + 1) * length].copy_(piece)
    count = len(results)
    if sorted(results) != list(range(count)) or len(seen) != count * (seq // length):
        raise RuntimeError(f"cp attention: staged compute left pieces out (got {sorted(seen)})")
    return [results[i] for i in range(count)]


def _gathered_blocks(p: int, length: int, causal: bool) -> list[tuple[slice, str]]:
    """(key slice of the gathered sequence, mask) that rank p's queries attend to."""
    if not causal:
        return [(slice(None), "full")]
    past = [(slice(0, p * length), "full")] if p else []
    return past + [(slice(p * length, (p + 1) * length), "causal")]


def _gather_kv(k: Tensor, v: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    kv = all_gather(torch.cat([k, v], dim=-1), 2, group, async_op=False).wait()
    return kv[..., : k.shape[-1]], kv[..., k.shape[-1] :]


def _allgather_fwd(q, k, v, causal, scale, group, backend):
    keys, values = _gather_kv(k, v, group)
    acc = Accumulator(q, v.shape[-1], acc_dtype(q.dtype))
    blocks = _gathered_blocks(group.rank(), q.shape[2], causal)
    for j, (ks, mask) in enumerate(blocks):
        acc.add(slice(None), *attend_fwd(q, keys[:, :, ks], values[:, :, ks], scale=scale, mask=mask, backend=backend),
                last=j == len(blocks) - 1)
    out, lse = acc.result()
    return out.to(q.dtype), lse


def _allgather_bwd(dout, saved: Saved, causal, scale, group, backend):
    q, k, v, out, lse = saved
    keys, values = _gather_kv(k, v, group)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    dkv = torch.zeros(keys.shape[:3] + (k.shape[-1] + v.shape[-1],), dtype=acc, device=q.device)
    for ks, mask in _gathered_blocks(group.rank(), q.shape[2], causal):
        dq_b, dk_b, dv_b = attend_bwd(dout, Saved(q, keys[:, :, ks], values[:, :, ks], out, lse), scale=scale,
                                      mask=mask, backend=backend)
        dq.add_(dq_b)
        dkv[:, :, ks].add_(torch.cat([dk_b, dv_b], dim=-1))
    dkv = reduce_scatter(dkv, 2, "sum", group, async_op=False).wait()  # dK/dV travel in fp32
    return dq.to(q.dtype), dkv[..., : k.shape[-1]].to(k.dtype, copy=True), dkv[..., k.shape[-1] :].to(v.dtype, copy=True)
