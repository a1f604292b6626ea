"""Cost estimates of the FlexAttention context-parallel schedules from the mask's work.

work[p][s] is the fraction of a full L x L block (L = S / W) that rank p computes against source
s's keys: for a causal mask over contiguous shares 1 below the diagonal, 1/2 on it and 0 above; a
document or window mask keeps less.  The schedules (kernels/attention/flex_ring.py,
flex_allgather.py), with the links and launches of cost.CPMachine:

    ring            W steps; step i computes block (p, p - i) beside the transfer of the next
                    K/V share; the backward's dK/dV sums travel in fp32 one step behind.  Its
                    blocks run at RING_BLOCK_RATE of one call's rate (a call and a merge per block).
    allgather:g=G   the whole K/V gathered in G head groups, group g + 1's gather beside group g's
                    one flex call of the rank's rows (no merge); the backward gathers again and
                    reduce-scatters each group's whole-sequence dK/dV (in their own dtype over
                    two ranks, fp32 over more) beside the next group's call.  Only the first
                    gather and the last reduce-scatter are exposed.  One group (allgather) keeps
                    its gathered K/V where the program's config lets it (kept_gathers): its
                    backward gathers nothing.
    hybrid:U:R      Ulysses over U ranks (its all-to-alls of q, k, v and out exposed; backward: of
                    q, k, v, out, dout and the gradients), then the ring over R segments of U
                    ranks' rows on H / U heads: the mask's work cut in R x R blocks.

The busiest rank sets the time.  Both move the same bytes (every share to every rank); the
all-gather's one call a group runs faster, the ring holds one share of K/V at a time.
"""

from __future__ import annotations

import math

from torch_commopt.core.attention_spec import AttentionShape
from torch_commopt.tuner.attention.cost import DEPTH_MARGIN, CPMachine, _dtype, _ring_time

# The ring's per-rank compute over the all-gather's (one call of the rank's rows against every
# key): 0.74-0.99 forward and 0.69-0.99 backward by mask on an H200 (B1 H32/8 D128 bf16, 8K and
# 16K tokens a rank; benchmarks/results/flex_blocks_h200x1_*.md), about 0.9 on the dense masks
# where compute decides.
RING_BLOCK_RATE = 0.9
FLEX_MAX_HEAD_GROUPS = 4  # more groups' calls get too few heads to fill a GPU at 8K tokens a rank


def causal_work(world: int) -> list[list[float]]:
    """work of a causal mask over contiguous shares: what a rewrite assumes of a mask it cannot
    read (its tables are a batch's data), the most a causal-based mask (documents, windows) keeps."""
    return [[1.0 if s < p else 0.5 if s == p else 0.0 for s in range(world)] for p in range(world)]


def _block_s(shape: AttentionShape, world: int, m: CPMachine) -> float:
    """A full L x L block's forward: 4 B H L^2 D FLOPs."""
    b, h, _, seq, d = shape
    return 4 * b * h * (seq // world) ** 2 * d / m.flops_per_s


def _share_bytes(shape: AttentionShape, world: int, elt: int) -> tuple[float, float]:
    """(K + V bytes of one share, their fp32 gradients')."""
    b, _, h_kv, seq, d = shape
    kv = 2 * b * h_kv * (seq // world) * d * elt
    return kv, kv * 4 / elt


def _ring_ms(shape: AttentionShape, work: list, m: CPMachine, elt: int, backward: bool) -> float:
    world = len(work)
    rows = [[work[p][(p - i) % world] for i in range(world)] for p in range(world)]  # each rank's steps in ring order
    block, (kv, dkv) = _block_s(shape, world, m) / RING_BLOCK_RATE, _share_bytes(shape, world, elt)
    hop = m.launch_s + m.link(kv)
    t = _ring_time(rows, block, m.launch_s, hop, 0.0)
    if backward:
        grad_hop = m.launch_s + m.link(dkv)
        t += _ring_time(rows, m.bwd_factor * block, m.launch_s, hop + grad_hop, grad_hop)
    return 1e3 * t


def _allgather_ms(shape: AttentionShape, work: list, groups: int, m: CPMachine, elt: int, backward: bool,
                  kept: bool = False) -> float:
    """kept: one group whose gathered K/V the backward reuses (no gather there)."""
    world = len(work)
    busiest = max(sum(row) for row in work) * _block_s(shape, world, m)
    kv, dkv = _share_bytes(shape, world, elt)
    gather = m.ring_collective(kv / groups, world)
    call = busiest / groups + m.launch_s
    t = gather + (groups - 1) * max(call, gather) + call
    if backward:
        # dK/dV reduce-scattered in their own dtype over two ranks, in fp32 over more
        scatter = m.ring_collective((kv if world == 2 else dkv) / groups, world)
        call = m.bwd_factor * busiest / groups + m.launch_s
        regather = 0.0 if kept and groups == 1 else gather
        t += regather + (groups - 1) * max(call, gather + scatter) + call + scatter
    return 1e3 * t


def segment_work(work: list, u: int) -> list[list[float]]:
    """The work of R = W / U segments of U consecutive ranks' rows against each other's keys, as
    fractions of a full segment x segment block (its U x U blocks' mean)."""
    r = len(work) // u
    return [[sum(work[g * u + i][h * u + j] for i in range(u) for j in range(u)) / (u * u) for h in range(r)]
            for g in range(r)]


def _moves_s(shape: AttentionShape, world: int, over: int, m: CPMachine, elt: int) -> float:
    """A Ulysses pass's exposed all-to-alls over `over` ranks: q and the output (H heads), k and v
    (H_kv heads), each of a rank's share of S / world tokens."""
    b, h, h_kv, seq, d = shape
    q_bytes, kv_bytes = b * (seq // world) * h * d * elt, b * (seq // world) * h_kv * d * elt
    return 2 * m.all_to_all(q_bytes, over) + 2 * m.all_to_all(kv_bytes, over)


def _hybrid_ms(shape: AttentionShape, work: list, u: int, m: CPMachine, elt: int, backward: bool) -> float:
    b, h, h_kv, seq, d = shape
    ring = _ring_ms(AttentionShape(b, h // u, h_kv // u, seq, d), segment_work(work, u), m, elt, backward) / 1e3
    moves = _moves_s(shape, len(work), u, m, elt)
    return 1e3 * (ring + (3 if backward else 1) * moves)


def ulysses_ms(shape, work: list, *, dtype, machine: CPMachine, backward: bool = False) -> float:
    """Predicted ms of a program's own Ulysses around flex_attention (what a flex_ulysses region
    keeps when it is not rewritten): every rank's H/W heads over the whole mask, the busiest rank
    then doing the average work (heads balance it exactly), with its all-to-alls of q, k, v and
    the output (backward: of dout, and of dq, dk, dv) exposed."""
    shape, m = AttentionShape(*shape), machine
    world = len(work)
    compute = sum(map(sum, work)) / world * _block_s(shape, world, m)
    moves = _moves_s(shape, world, world, m, _dtype(dtype).itemsize)
    t = moves + compute + m.launch_s
    if backward:
        t += moves + m.bwd_factor * compute + m.launch_s
    return 1e3 * t


def flex_estimate_ms(schedule: str, shape, work: list, *, dtype, machine: CPMachine, backward: bool = False,
                     kept_gathers: bool = False) -> float:
    """Predicted ms of one call (forward, or forward + backward) of a flex schedule
    (core.attention_spec.parse_flex_schedule's names) for the global shape (B, H, H_kv, S, D)
    over len(work) ranks; math.inf where the head groups (the hybrid's Ulysses ranks) do not split the
    KV heads, or the hybrid's degrees are not the group's.  kept_gathers: the one-group all-gather
    keeps its gathered K/V for the backward."""
    from torch_commopt.core.attention_spec import flex_hybrid_degrees, parse_flex_schedule

    name, groups = parse_flex_schedule(schedule)
    shape, elt = AttentionShape(*shape), _dtype(dtype).itemsize
    if name == "ring":
        return _ring_ms(shape, work, machine, elt, backward)
    if name == "hybrid":
        u, r = flex_hybrid_degrees(schedule)
        if u * r != len(work) or shape.kv_heads % u or shape.heads % u:
            return math.inf
        return _hybrid_ms(shape, work, u, machine, elt, backward)
    if shape.kv_heads % groups:
        return math.inf
    return _allgather_ms(shape, work, groups, machine, elt, backward, kept_gathers)


def flex_candidates(shape, per_head_mask: bool, world: int = 2, own_rows: bool = False) -> list[str]:
    """ring, allgather and allgather:g=G for the G <= FLEX_MAX_HEAD_GROUPS that split the KV heads
    (none where the mask differs per head: its groups would run as one), and hybrid:U:R for the
    U, R >= 2 of the world whose U splits the heads (not for a per-head mask, nor one of the rank's
    own rows: the hybrid's ring runs a segment's)."""
    shape = AttentionShape(*shape)
    depths = [] if per_head_mask else [g for g in range(2, FLEX_MAX_HEAD_GROUPS + 1) if shape.kv_heads % g == 0]
    hybrids = [] if per_head_mask or own_rows else [
        f"hybrid:{u}:{world // u}" for u in range(2, world // 2 + 1)
        if world % u == 0 and shape.kv_heads % u == 0 and shape.heads % u == 0]
    return ["ring", "allgather", *(f"allgather:g={g}" for g in depths), *hybrids]


def rank_flex_schedules(shape, work: list, *, dtype, machine: CPMachine, backward: bool = False,
                        per_head_mask: bool = False, own_rows: bool = False,
                        kept_gathers: bool = False) -> list[tuple[str, float]]:
    """(schedule, predicted ms), fastest first; a head-group depth ranks as if DEPTH_MARGIN slower
    (cost.DEPTH_MARGIN: it goes first only where the model says it gains more than that)."""
    est = [(s, flex_estimate_ms(s, shape, work, dtype=dtype, machine=machine, backward=backward,
                                kept_gathers=kept_gathers))
           for s in flex_candidates(shape, per_head_mask, len(work), own_rows)]
    est.sort(key=lambda e: (e[1] * (1 + DEPTH_MARGIN if ":g=" in e[0] else 1), e[0]))
    return est
