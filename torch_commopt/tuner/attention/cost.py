"""Cost estimates of the context-parallel attention schedules: alpha-beta links + attention FLOPs.

Pure arithmetic (no device, no process group), so the tuner can rank schedules anywhere.

    link(m bytes)       alpha + m / bw                        one message (a ring step's K/V)
    issuing an op       launch                                every kernel (an attention block, a
                                                              merge) and every communication call
    all-gather / reduce-scatter of m bytes per rank:  launch + (P-1) * link(m)
    all-to-all of m bytes per rank (pairwise, full bisection):  launch + alpha + (P-1)/P * m / bw
    attention block of a queries x b keys, h heads:  4*B*h*a*b*D FLOPs forward (two matmuls),
        half of it on a causal diagonal block; backward 2.5x (five matmuls, s recomputed).

A ring step costs max(compute, transfer): the transfer of the next block (one launch, one
link) runs beside the compute of this one (a block and its merge: two launches).  The slowest
rank sets the time, so a causal contiguous ring costs what its last rank does (W - 1/2 blocks)
while zigzag costs the average (W/2 blocks).  The all-gather is not overlapped; the
all-to-alls of ulysses/hybrid and the zigzag relayouts are pipelined over head groups, so only
the first group's inputs and the last group's results are charged.  What the model says at its ends:
short sequences are bound by launches and latencies, where one collective (allgather, or
ulysses's two all-to-alls at W > 2) beats W - 1 ring steps; long causal sequences are bound
by the slowest rank's blocks, where zigzag's balance pays for its two relayouts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Union

import torch

from torch_commopt.core.attention_spec import (
    ULYSSES_MAX_HEAD_GROUPS,
    AttentionShape,
    CPSchedule,
    pipeline_groups,
    refusal,
)

log = logging.getLogger("torch_commopt.tuner.attention.cost")

# the backward's time over the forward's: cuDNN on an H200, B1 H32 D128 bf16, 16K-64K: 2.72
# (causal) - 2.81 (full) (docs/context-parallel-attention.md, "Measurements behind the constants")
BWD_FLOP_FACTOR = 2.75
ShapeLike = Union[AttentionShape, tuple]


@dataclass(kw_only=True, frozen=True)
class CPMachine:
    """What the model knows about the machine.

    link_bytes_per_s: one link's bandwidth; alpha_s: latency of one message (one ring step,
    one hop of a collective); flops_per_s: the attention kernel's throughput on one device;
    launch_s: the cost of issuing one kernel or one communication call (host + launch);
    bwd_factor: the backward's time over the forward's for the same block;
    concurrent_groups: Ulysses's later head groups start while the previous group's attention
        finishes (ce_a2a's group streams, GPUs), so their launches cost nothing -- in the
        forward; concurrent_backward: in the backward (both by default; ce_a2a.GROUP_STREAMS_ENV);
    ce_all_to_all: Ulysses's all-to-alls run by the copy engine (ce_a2a): they launch no
        collective (their host time is host_call_s / host_pass_s), so an exchange costs the link;
    host_call_s, host_pass_s: the host time of one call of a schedule whose all-to-alls run by
        the copy engine (ce_a2a) -- its schedules layer -- and of each head group's pass through
        the pipeline (the copies, flags and events it queues, the attention's launch; a training
        call makes 2G passes, an inference call G): back-to-back calls take max(device, host)
        (0: not charged, the NCCL path and CPUs);
    host_pass_concurrent_s: a pass's host time where the head groups run on two compute streams
        (concurrent_groups / concurrent_backward for its pass, pure Ulysses, G > 1; 0:
        host_pass_s).  One group has no second stream, so it pays host_pass_s.
    """

    link_bytes_per_s: float
    alpha_s: float
    flops_per_s: float
    launch_s: float = 0.0
    bwd_factor: float = BWD_FLOP_FACTOR
    concurrent_groups: bool = False
    concurrent_backward: bool = False
    ce_all_to_all: bool = False
    host_call_s: float = 0.0
    host_pass_s: float = 0.0
    host_pass_concurrent_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("link_bytes_per_s", "flops_per_s", "bwd_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CPMachine.{name} must be > 0, got {getattr(self, name)}")
        for name in ("alpha_s", "launch_s", "host_call_s", "host_pass_s", "host_pass_concurrent_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CPMachine.{name} must be >= 0, got {getattr(self, name)}")

    def link(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.link_bytes_per_s

    def ring_collective(self, piece_bytes: float, p: int) -> float:
        return self.launch_s + (p - 1) * self.link(piece_bytes) if p > 1 else 0.0

    def all_to_all(self, nbytes: float, p: int) -> float:
        return self.launch_s + self.alpha_s + (p - 1) / p * nbytes / self.link_bytes_per_s if p > 1 else 0.0


# attention kernels reach about this fraction of the GEMM fit's peak: cuDNN's forward (the
# local backend on sm90) runs at 576-615 TFLOP/s on an H200 (B1 H32 D128 bf16, S 16K-64K,
# causal and full), against the GEMM fit's ~880 TFLOP/s peak there: 0.65-0.70 (aten flash
# reaches 0.40; docs/context-parallel-attention.md).  Not calibrated per machine.
ATTENTION_OF_GEMM_PEAK = 0.67


# Host time of the copy-engine Ulysses pipeline (ce_a2a), from its enqueue time on an H100 pair
# (B1 H32 D128 causal fwd+bwd, 1/2/4 head groups): 0.5-0.75 ms a group-pass with one compute
# stream, 0.8-1.4 ms with the groups on two, the rest of a call ~0.2 ms.  At 8K tokens a call is
# host-bound: two groups on two streams run 4.5-5.5 ms against one group's 2.6-3.5, where a
# device-only model ranks them 2.71 vs 2.89 ms (docs/context-parallel-attention.md, "Cost model
# and tuning").  Scaled by the machine's measured host speed (its ce_push host figure against
# the prior's).
HOST_CALL_S = 0.2e-3
HOST_PASS_S = 0.6e-3
HOST_PASS_CONCURRENT_S = 0.9e-3


def machine_from_calibration(cal, dtype: str) -> CPMachine:
    """The attention model's machine figures from the tuner's calibration (tuner/calibration.py):
    a copy-engine push per ring step where the machine has one, else the all-gather's link;
    the local attention kernel's measured throughput and backward factor (else the GEMM fit's
    peak scaled to attention, and BWD_FLOP_FACTOR); the NCCL path's host cost per call;
    concurrent head groups where the all-to-alls run by the copy engine (a machine with p2p,
    ce_a2a.ENV not nccl), in the passes ce_a2a.GROUP_STREAMS_ENV asks for; the copy-engine
    pipeline's host time at this machine's host speed against the prior's."""
    from torch_commopt.kernels.attention import ce_a2a
    from torch_commopt.tuner.calibration import prior

    link = cal.p2p if cal.p2p is not None else cal.collective["all_gather"]
    flops = cal.attention_flops.get(dtype) or cal.gemm_fit(dtype).peak_flops * ATTENTION_OF_GEMM_PEAK
    bwd = cal.attention_bwd_factor or BWD_FLOP_FACTOR
    ce = cal.p2p is not None and ce_a2a.transport() == "ce"
    passes = ce_a2a.group_stream_passes() if ce else ()
    concurrent, concurrent_bwd = "fwd" in passes, "bwd" in passes
    speed = min(3.0, max(0.5, cal.host("ce_push") / prior(cal.device, cal.world).host("ce_push"))) if ce else 0.0
    return CPMachine(link_bytes_per_s=link.bytes_per_s, alpha_s=link.alpha_s, flops_per_s=flops,
                     launch_s=cal.host("sequential"), bwd_factor=bwd, concurrent_groups=concurrent,
                     concurrent_backward=concurrent_bwd, ce_all_to_all=ce, host_call_s=speed * HOST_CALL_S,
                     host_pass_s=speed * HOST_PASS_S,
                     host_pass_concurrent_s=speed * HOST_PASS_CONCURRENT_S if concurrent or concurrent_bwd else 0.0)


@dataclass(frozen=True)
class _Sizes:
    """Per-rank bytes of one call: q (and out, dout, dq), k + v (and dk + dv), lse."""

    q: float
    kv: float
    dkv: float  # dK/dV in fp32 (the all-gather's reduce-scatter, a ring's middle hops)
    lse: float


def _sizes(shape: AttentionShape, world: int, elt: int) -> _Sizes:
    b, h, h_kv, seq, d = shape
    s_loc = seq // world
    kv = 2 * b * h_kv * s_loc * d * elt
    return _Sizes(b * h * s_loc * d * elt, kv, kv * 4 / elt, b * h * s_loc * 4)


def _ring_fractions(n: int, causal: bool, zigzag: bool) -> list[list[float]]:
    """Per rank, per step: the fraction of a full L x L block it computes (from the plan the
    schedule runs, ring.py)."""
    from torch_commopt.kernels.attention.ring import block_fractions, contiguous_plan, zigzag_plan

    return block_fractions((zigzag_plan if zigzag else contiguous_plan)(causal), n)


def _ring_time(fractions: list[list[float]], block_s: float, launch_s: float, transfer_s: float,
               tail_s: float) -> float:
    """The slowest rank's time: each step's compute (a block and its merge) beside the next
    step's transfer; `tail_s` is exposed after the last step (the backward's final dK/dV hop)."""
    worst = 0.0
    for row in fractions:
        compute = [f * block_s + (2 * launch_s if f else 0.0) for f in row]
        t = sum(max(c, transfer_s) for c in compute[:-1]) + compute[-1]
        worst = max(worst, t + tail_s)
    return worst


def _allgather_seconds(shape: AttentionShape, causal: bool, world: int, sz: _Sizes, m: CPMachine,
                       backward: bool) -> float:
    b, h, _, seq, d = shape
    s_loc = seq // world
    block_s = 4 * b * h * s_loc * s_loc * d / m.flops_per_s
    # the last rank: (W - 1) full blocks and the causal diagonal in two kernels, or W in one
    kernels = 2 if causal and world > 1 else 1
    compute = (world - 0.5 if causal else world) * block_s
    launches = 2 * kernels * m.launch_s  # each block and its merge
    fwd = m.ring_collective(sz.kv, world) + compute + launches
    if not backward:
        return fwd
    bwd = m.ring_collective(sz.kv, world) + m.bwd_factor * compute + launches
    return fwd + bwd + m.ring_collective(sz.dkv, world)


def _ring_seconds(sched: CPSchedule, shape: AttentionShape, causal: bool, world: int, sz: _Sizes,
                  m: CPMachine, backward: bool) -> float:
    """ring, ring_zigzag, ulysses and hybrid: all-to-alls (or zigzag relayouts) around a ring."""
    b, h, _, seq, d = shape
    zigzag = sched.name == "ring_zigzag" and causal
    u, r = sched.degrees(world)
    length = u * (seq // world)
    block_s = 4 * b * (h // u) * length * length * d / m.flops_per_s
    fractions = _ring_fractions(r, causal, zigzag)
    group = world if zigzag else u  # who takes part in the exchanges before and after the ring

    # ring_zigzag and ulysses/hybrid pipeline their relayouts / all-to-alls over G head groups
    # (spec.pipeline_groups: the schedule's g=G or the rule's): the ring runs G times on 1/G of the
    # heads and only the first group's inputs and the last group's results are exposed; the
    # other exchanges hide behind the rings.
    groups = pipeline_groups(sched, int(sz.q), h, shape.kv_heads, world) if zigzag or u > 1 else 1

    # the copy-engine pipeline launches no collective: its host time is `host` below, so an
    # exchange costs the link alone (on the default sweep 23 of 24 picks land within 5% of the
    # measured best with this, 22 without; benchmarks/attention_picks.py)
    ce = not zigzag and u > 1 and m.ce_all_to_all

    def exchange(nbytes: float) -> float:
        t = m.all_to_all(nbytes / groups, group)
        return t - m.launch_s if ce and group > 1 else t

    def rings(block: float, transfer: float, tail: float, concurrent: bool) -> float:
        one = _ring_time(fractions, block / groups, m.launch_s, transfer, tail)
        if r == 1 and concurrent:  # the later groups queue behind the first: no launches of their own
            return one + (groups - 1) * _ring_time(fractions, block / groups, 0.0, transfer, tail)
        return groups * one

    kv = sz.kv  # the zigzag relayout and Ulysses's all-to-alls move K/V too
    hop = m.launch_s + m.link(kv / groups) if r > 1 else 0.0
    # the copy-engine pipeline's host time (Ulysses and hybrid; zigzag's relayouts are NCCL's)
    # (on two compute streams only with two or more groups of pure Ulysses: at 8K tokens one
    # group's forward enqueues in ~0.75 ms, where two streams' figure would charge 1.1)
    def per_pass(concurrent: bool) -> float:
        two_streams = r == 1 and groups > 1 and concurrent
        return (m.host_pass_concurrent_s or m.host_pass_s) if two_streams else m.host_pass_s
    passes = per_pass(m.concurrent_groups) + (per_pass(m.concurrent_backward) if backward else 0.0)
    host = 0.0 if zigzag or u <= 1 else m.host_call_s + groups * passes
    if not backward:  # inference: out and the lse come back
        return max(host, exchange(sz.q + kv) + rings(block_s, hop, 0.0, m.concurrent_groups) + exchange(sz.q + sz.lse))
    # training (the kept pair, schedules.cp_attention_fwd_keep): the forward moves out alone
    # back and keeps q, k, v, out, lse where its attention ran; the backward moves dout there.
    fwd = exchange(sz.q + kv) + rings(block_s, hop, 0.0, m.concurrent_groups) + exchange(sz.q)
    # dK/dV sums (ring.GradRing): the last hop in the input dtype, the others in fp32 except
    # while a block's sums hold one kernel term (at world 2: every hop in the input dtype)
    dkv_hop = m.launch_s + m.link((kv if r == 2 else sz.dkv) / groups) if r > 1 else 0.0
    dkv_last = m.launch_s + m.link(kv / groups) if r > 1 else 0.0
    bwd = exchange(sz.q) + rings(m.bwd_factor * block_s, hop + dkv_hop, dkv_last, m.concurrent_backward) + \
        exchange(sz.q + kv)
    return max(host, fwd + bwd)


def _dtype(dtype: Union[torch.dtype, str]) -> torch.dtype:
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"estimate_ms: dtype must be a torch dtype or its name, got {dtype!r}")
    return dt


def estimate_ms(schedule: Union[str, CPSchedule], shape: ShapeLike, *, world: int, causal: bool,
                dtype: Union[torch.dtype, str], machine: CPMachine, backward: bool = False) -> float:
    """Predicted milliseconds of one call of `schedule` (forward, or forward + backward with
    backward=True) for global q (B, H, S, D), k/v (B, H_kv, S, D) over `world` ranks;
    math.inf where the schedule refuses the shape (spec.refusal).

    shape: AttentionShape (batch, heads, kv_heads, seq, head_dim) or such a tuple;
    dtype: of q/k/v (torch dtype or its name)."""
    sched, shape, dt = CPSchedule.parse(schedule), AttentionShape(*shape), _dtype(dtype)
    if refusal(sched, shape, world, causal) is not None:
        return math.inf
    sz = _sizes(shape, world, dt.itemsize)
    if sched.name == "allgather":
        seconds = _allgather_seconds(shape, causal, world, sz, machine, backward)
    else:
        seconds = _ring_seconds(sched, shape, causal, world, sz, machine, backward)
    return 1e3 * seconds


def candidates(shape: ShapeLike, *, world: int, causal: bool,
               dtype: Union[torch.dtype, str, None] = None) -> list[CPSchedule]:
    """Every schedule that takes `shape` over `world` ranks: allgather, ring, ring_zigzag
    (causal only: without a mask it is ring), ulysses and the proper hybrids hybrid:U:R
    (1 < U < W); the refused ones (spec.refusal) are left out.  Not ulysses:early: run only
    where named (its block split runs 1-4% slower than ulysses:g=1 at 16K tokens; estimate_ms
    charges it as ulysses with its depth, without the split's cost).  With `dtype`, also the other
    head-group depths of the schedules that move their inputs (depth_variants)."""
    names = ["allgather", "ring"] + (["ring_zigzag"] if causal else []) + ["ulysses"]
    names += [f"hybrid:{u}:{world // u}" for u in range(2, world) if world % u == 0]
    scheds = [CPSchedule.parse(n) for n in names]
    out = [s for s in scheds if refusal(s, shape, world, causal) is None]
    if dtype is None:
        return out
    return out + [v for s in out for v in depth_variants(s, shape, world=world, causal=causal, dtype=dtype)]


def depth_variants(sched: Union[str, CPSchedule], shape: ShapeLike, *, world: int, causal: bool,
                   dtype: Union[torch.dtype, str]) -> list[CPSchedule]:
    """The other head-group depths of a schedule named without one (`ulysses:g=1` where the
    rule, spec.pipeline_groups, gives ulysses two groups), g = 1..ULYSSES_MAX_HEAD_GROUPS, those
    the shape takes; [] for a schedule that moves nothing or names its depth.  The model weighs
    a depth's hidden moves against its extra launches; a measurement (tuner/attention/tune.py) also
    sees the split's cost to the attention kernel itself."""
    sched, shape = CPSchedule.parse(sched), AttentionShape(*shape)
    u = sched.degrees(world)[0]
    if sched.groups or sched.name not in CPSchedule.PIPELINED or (sched.name == "ring_zigzag" and not causal) \
            or (sched.name != "ring_zigzag" and u <= 1):
        return []
    b, h, h_kv, seq, d = shape
    rule = pipeline_groups(sched, b * h * (seq // world) * d * _dtype(dtype).itemsize, h, h_kv, world)
    variants = [CPSchedule(sched.name, sched.ulysses, sched.ring, g) for g in range(1, ULYSSES_MAX_HEAD_GROUPS + 1)]
    return [v for v in variants if v.groups != rule and refusal(v, shape, world, causal) is None]


# A head-group depth other than the rule's (depth_variants) ranks as if predicted DEPTH_MARGIN
# slower than it is: it goes ahead of the rule's depth only where the model predicts it faster by
# more than that.  The model's gain for a depth is the exposed moves it hides against the host
# time it adds, both coarse where they are close: where the model puts another depth first by a
# few percent (ulysses:g=2, 4K tokens a GPU, non-causal fwd+bwd, MHA and GQA, 3-4% predicted
# faster) it runs 12-29% slower than the rule's one group.  Replayed over the stored 2-GPU runs
# (attention_picks.py, the priors; 241 cases with a timed pick): 230 picks within 5% of the best
# against 227 without the margin, none lost (docs/context-parallel-attention.md).
DEPTH_MARGIN = 0.05


def rank_schedules(shape: ShapeLike, *, world: int, causal: bool, dtype: Union[torch.dtype, str],
                   machine: CPMachine, backward: bool = False, depths: bool = False) -> list[tuple[str, float]]:
    """(schedule name, predicted ms) of the candidates, fastest first (ties: by name; a depth
    variant by its prediction times 1 + DEPTH_MARGIN); depths: with the other head-group depths
    of the schedules that move their inputs."""
    scheds = candidates(shape, world=world, causal=causal, dtype=dtype if depths else None)
    est = [(s, estimate_ms(s, shape, world=world, causal=causal, dtype=dtype, machine=machine, backward=backward))
           for s in scheds]
    # the candidates name no depth but the depth variants (candidates: plain names, then depth_variants)
    est.sort(key=lambda e: (e[1] * (1 + DEPTH_MARGIN if e[0].groups else 1), str(e[0])))
    return [(str(s), ms) for s, ms in est]


# Uncalibrated machine figures for the schedule ranking (tuner/attention/cost.py): 2x H200 NVLink
# and a gloo CPU pair, round numbers.
MACHINES = {"cuda": CPMachine(link_bytes_per_s=300e9, alpha_s=20e-6, flops_per_s=400e12, launch_s=20e-6),
            "cpu": CPMachine(link_bytes_per_s=2e9, alpha_s=50e-6, flops_per_s=20e9, launch_s=50e-6)}


def machine_for(device: torch.device, world: int, group_name: str | None, dtype: str, cache_dir: str | None,
                timeout_s: float) -> CPMachine:
    """The attention model's machine: from the tuner calibration of `device` over `world` ranks
    (rank 0's), else the round figures (MACHINES)."""
    return machine_and_source(device, world, group_name, dtype, cache_dir, timeout_s)[0]


def machine_and_source(device: torch.device, world: int, group_name: str | None, dtype: str, cache_dir: str | None,
                       timeout_s: float) -> tuple[CPMachine, str]:
    """(machine_for's machine, where its figures come from)."""
    from torch_commopt.tuner.machine import calibration_for

    try:
        cal = calibration_for(device, world, group_name, cache_dir, timeout_s)
        return machine_from_calibration(cal, dtype), f"tuner calibration ({cal.source}: {cal.device} x{cal.world})"
    except (KeyError, ValueError, RuntimeError) as e:  # no usable calibration: the round figures
        log.info("commopt attention: no calibration for %s (%s); using the round figures", device, e)
        return MACHINES["cuda" if device.type == "cuda" else "cpu"], f"cost.MACHINES round figures (no calibration: {e})"
