"""The cost model: predicted time and memory of each candidate schedule of a region.

A schedule is modelled as two in-order queues (MeshSlice / Mercury view): a compute
queue of GEMM steps and a transfer queue of communication steps, with "step j of one
queue waits for step i of the other" edges.  `simulate` computes the makespan exactly;
for a uniform pipeline of S steps it is the closed form
    T = prologue + (S - 1) * max(comm_step, compute_step) + epilogue
(`pipeline_time`, checked against `simulate` in the tests).  Back-to-back calls cost
max(GPU time, host time): below ~0.2 ms of GEMM a GPU schedule is bound by its Python.

Collectives use alpha-beta costs with the ring's (P-1)/P factors; copy-engine transfers
one alpha-beta link per piece; GEMMs the shape-dependent fit of the calibration.  Small
all-reduces (a decoder's few KB) take their measured latency where the calibration has it
(Calibration.small_msg), and the low-latency schedules `oneshot` / `twoshot` a prior else.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from torch_commopt.core.schedule import OP_SCHEDULES, Schedule
from torch_commopt.kernels.matmul.gpu.pick import LOWLAT_MAX_WORLD  # the rule's band: one NVLink host
from torch_commopt.tuner.calibration import Calibration


@dataclass(frozen=True)
class RegionShape:
    """What the model needs of a region (per rank).

    kind: "ag_matmul" (a: the local shard, gathered along rows), "matmul_rs" /
        "matmul_ar" (a: the full local input, the product is reduced over ranks).
    rows: rows of `a` as a matrix (prod of all dims but the last); k: its last dim.
    ns: the widths of the weights (several for q/k/v or w1/w3 sharing one all-gather).
    copy_bytes: bytes the graph copies for the region only where an op of ours runs it
        (concat-K's stacked weights and the A operands not computed in place,
        passes/matmul/concat_k.py): charged to every schedule but `sequential`, which keeps the
        region as compiled, uncopied.
    kept_bytes: what the region as compiled moves beyond one matmul, as device-copy bytes
        (concat-K: the sum of products it restores): charged to `sequential` only.
    k_parts: the K of each product where the region's matmul is a sum of products the op
        multiplies apart (concat-K's K parts, kernels/ops.k_parts; () : one product of K):
        the GEMM time is the parts' sum, and copy_bytes is then what `fused`, which multiplies
        them concatenated, copies per call (charged to `fused` only; its GEMM is still priced
        as the parts', a slight overcharge).
    """

    kind: str
    rows: int
    k: int
    ns: tuple[int, ...]
    world: int
    dtype: str = "bfloat16"
    copy_bytes: int = 0
    kept_bytes: int = 0
    k_parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in OP_SCHEDULES:
            raise ValueError(f"RegionShape.kind: unknown {self.kind!r}")
        if min(self.rows, self.k, self.world, *self.ns) < 1:
            raise ValueError(f"RegionShape: sizes must be positive, got {self}")
        if self.k_parts and (sum(self.k_parts) != self.k or min(self.k_parts) < 1):
            raise ValueError(f"RegionShape.k_parts: {self.k_parts} must be positive and add up to k = {self.k}")
        for name in ("copy_bytes", "kept_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"RegionShape.{name}: must be >= 0, got {getattr(self, name)}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"RegionShape.dtype: not a torch dtype name: {self.dtype!r}")

    @property
    def elt(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def scaled(self) -> bool:
        """A float8 region: its matmuls are torch._scaled_mm (kernels/scaled.py)."""
        return self.dtype.startswith("float8")

    @property
    def out_elt(self) -> int:
        """Bytes of one element of the product: a float8 product comes out in bf16 / fp16."""
        return 2 if self.scaled else self.elt


@dataclass(frozen=True)
class RegionFacts:
    """A matmul-collective region's static facts as its op receives them (per rank): what the
    model's choice (`shape`), the GPU kernels' refusal and the tuner cache's keys are made of,
    passed whole from the compile pass, the tune CLI and the benchmarks.

    a_shape: the op's A operand (ag_matmul: the local shard); weight_shapes: each weight's
        (K, N); dim: the gather / scatter dim (None for matmul_ar); world: the group's size.
    bias: whether each matmul adds a bias (() : none does); reduce_op, keep_gathered: the op's.
    copy_bytes, kept_bytes, k_parts: as RegionShape's.
    Shapes are kept as tuples (the value is hashable); the keys built from it hold lists.
    """

    kind: str
    a_shape: tuple[int, ...]
    weight_shapes: tuple[tuple[int, ...], ...]
    dim: int | None
    world: int
    dtype: str
    bias: tuple[bool, ...] = ()
    reduce_op: str | None = None
    keep_gathered: bool = False
    copy_bytes: int = 0
    kept_bytes: int = 0
    k_parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # callers hand lists (graph metadata, parsed specs): stored as tuples
        object.__setattr__(self, "a_shape", tuple(self.a_shape))
        object.__setattr__(self, "weight_shapes", tuple(tuple(w) for w in self.weight_shapes))
        object.__setattr__(self, "bias", tuple(self.bias) or (False,) * len(self.weight_shapes))
        object.__setattr__(self, "k_parts", tuple(self.k_parts))
        if len(self.bias) != len(self.weight_shapes):
            raise ValueError(f"RegionFacts.bias: {len(self.bias)} flags for {len(self.weight_shapes)} weights")

    @property
    def shape(self) -> RegionShape:
        """The model's view of the region (rows of A as a matrix, the weights' widths)."""
        return RegionShape(self.kind, math.prod(self.a_shape[:-1]), self.a_shape[-1],
                           tuple(w[-1] for w in self.weight_shapes), self.world, self.dtype, self.copy_bytes,
                           self.kept_bytes, self.k_parts)


@dataclass(frozen=True)
class Prediction:
    schedule: Schedule
    seconds: float  # what a back-to-back call costs: max(gpu_s, host_s)
    gpu_s: float
    host_s: float
    extra_bytes: int  # device memory beyond inputs and outputs (staging, gathered A, buffers)
    pool_bytes: int = 0  # of which the symmetric buffer requested (kept, shared per size class)


@dataclass
class _Step:
    queue: str  # "compute", "comm" (the side stream's copies) or "local" (the local copy stream)
    seconds: float
    after: tuple[int, ...] = ()  # indices of steps (either queue) this one waits for


def simulate(steps: list[_Step]) -> float:
    """Makespan of steps issued in list order to in-order queues (named by _Step.queue)."""
    end: list[float] = []
    free: dict[str, float] = {}
    for step in steps:
        start = max([free.get(step.queue, 0.0)] + [end[i] for i in step.after])
        end.append(start + step.seconds)
        free[step.queue] = end[-1]
    return max(end, default=0.0)


def pipeline_time(prologue: float, steps: int, comm_step: float, compute_step: float, epilogue: float) -> float:
    """Closed form of a uniform pipeline (comm of piece j+1 under compute of piece j)."""
    return prologue + max(0, steps - 1) * max(comm_step, compute_step) + epilogue


def collective_time(cal: Calibration, name: str, full_bytes: float, world: int) -> float:
    """Ring collective over `world` ranks of a tensor of `full_bytes` (the gathered /
    un-scattered size): (P-1) steps of full/P bytes; all_reduce twice that."""
    if world == 1:
        return 0.0
    step = cal.collective[name].time(full_bytes / world)
    return (world - 1) * step * (2 if name == "all_reduce" else 1)


def predict(shape: RegionShape, sched: Schedule, cal: Calibration, *, graphs: bool | str = False) -> Prediction:
    """Predicted cost of running `shape` with `sched` on the calibrated machine.  graphs=True
    (GPUs): the calls are replayed from a CUDA graph, which pays no per-call host cost;
    graphs=PER_CALL (calibration.PER_CALL): each eager call replays its own graph, ranked as
    replayed with the per-call replays' measured slowdown (Calibration.call_graph_slowdown)."""
    if not sched.valid_for(shape.kind):
        raise ValueError(f"cost model: {shape.kind} has no schedule {sched.name!r}")
    if sched.is_gpu and cal.p2p is None:
        raise ValueError(f"cost model: {sched} needs symmetric memory; {cal.device} has none")
    if graphs:  # what runs inside a capture (a fused reduction: ce_push, Schedule.in_capture)
        sched = sched.in_capture(shape.kind)
    fn = _ag_time if shape.kind == "ag_matmul" else _reduce_time
    raw = fn(shape, sched, cal)
    gpu = raw * cal.factor(factor_key(shape.kind, sched), raw, graphs=graphs) + _graph_copies(shape, sched, cal)
    pieces = 1 if sched.name in ("sequential", "local_first", "oneshot", "twoshot") \
        else sched.chunks * max(1, shape.world - 1)
    family = host_family(sched)
    if family != sched.name and f"{shape.kind} {family}" not in cal.host_s:  # not probed: its name's figure
        family = sched.name
    host = cal.host(family, shape.kind) + (0 if pieces == 1 else pieces * cal.per_piece(shape.kind))
    if graphs and cal.device != "cpu":
        host = 0.0
    # A GPU runs the device work while the host enqueues the next call: back-to-back calls
    # take the longer of the two.  On a CPU the host *is* the device: they add up.
    seconds = gpu + host if cal.device == "cpu" else max(gpu, host)
    return Prediction(sched, seconds, gpu, host, extra_bytes(shape, sched), pool_bytes(shape, sched))


def host_family(sched: Schedule) -> str:
    """The family a schedule's host cost is probed and looked up under (Calibration.host_s): its
    name, "ce_push:par=1" for the variant that also forks and joins a second stream, and
    "fused:impl=sm90" for the fused calls whose one native launch is replayed (host_replay), where
    the Triton kernels' calls run their Python host code."""
    if sched.name == "fused" and sched.param("impl") == "sm90":
        return "fused:impl=sm90"
    return sched.name + (":par=1" if sched.param("par") else "")


def _graph_copies(shape: RegionShape, sched: Schedule, cal: Calibration) -> float:
    """The copies the graph makes for this region's op (shape.copy_bytes) or, kept as
    compiled, what the kept form moves beyond one matmul (shape.kept_bytes).  A cat reads
    and writes its bytes as a device-local copy does (no such figure: free)."""
    if sched.name == "sequential":
        moved = shape.kept_bytes
    else:  # K parts: only `fused` concatenates them (shape.k_parts)
        moved = shape.copy_bytes if not shape.k_parts or sched.name == "fused" else 0
    if not moved or cal.local_copy is None:
        return 0.0
    return cal.local_copy.time(moved)


def factor_key(kind: str, sched: Schedule) -> str:
    """The calibration key of a schedule's own factor: "kind name:S", with its variant
    parameters (gemm=whole, par=1, tma=1, impl=sm90) where it has any; Calibration.factor falls
    back to "kind name"."""
    key = f"{kind} {sched.name}:{sched.chunks}"
    if sched.param("gemm") == "whole":
        key += ":gemm=whole"
    if sched.param("par"):
        key += ":par=1"
    if sched.param("tma"):
        key += ":tma=1"
    if sched.param("impl") == "sm90":
        key += ":impl=sm90"
    return key


def fused_efficiency(kind: str, sched: Schedule, cal: Calibration) -> float:
    """A fused schedule's GEMM speed relative to cuBLAS: the sm_90a kernels' (impl=sm90) where the
    calibration has their figure for this op, else the Triton kernels'."""
    if sched.param("impl") == "sm90" and kind in cal.sm90_efficiency:
        return cal.sm90_efficiency[kind]
    return cal.fused_efficiency


# A float8 GEMM without a float8 calibration: the bf16 fit at this rate (Hopper's dense
# float8 peak is twice its bf16 one; calibration measures bf16 / fp16 / fp32 only).
FLOAT8_SPEEDUP = 2.0


def _gemm(shape: RegionShape, cal: Calibration, rows: float) -> float:
    """The region's GEMMs over `rows` rows: timed figures where the calibration's table holds
    them (Calibration.gemm_time), else the fit."""
    rows = max(1, int(rows))
    t = sum(cal.gemm_time(shape.dtype, rows, n, k) for n in shape.ns for k in (shape.k_parts or (shape.k,)))
    return t / FLOAT8_SPEEDUP if shape.scaled and shape.dtype not in cal.gemm else t


class _Asked(dict):
    """An empty GEMM table that notes every key the model looks up in it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return default


def gemm_keys(shape: RegionShape, cal: Calibration, schedules: list[Schedule], *, graphs: bool | str = False) -> list[str]:
    """The GEMMs (Calibration.gemm_table keys) the model prices to rank `schedules` for `shape`:
    what tuner.gemm_table times before the ranking."""
    asked = _Asked()
    probe = dataclasses.replace(cal, gemm_table=asked)
    for sched in schedules:
        predict(shape, sched, probe, graphs=graphs)
    return sorted(asked.asked)


def _ag_time(shape: RegionShape, sched: Schedule, cal: Calibration) -> float:
    w, m_loc = shape.world, shape.rows
    shard_bytes = m_loc * shape.k * shape.elt
    if sched.name == "sequential":
        return collective_time(cal, "all_gather", w * shard_bytes, w) + _gemm(shape, cal, w * m_loc)
    if sched.name == "local_first":  # the own shard's GEMM beside the gather, then the rest
        comm = collective_time(cal, "all_gather", w * shard_bytes, w)
        own = _gemm(shape, cal, m_loc)
        steps = [_Step("comm", comm), _Step("compute", own + cal.collective_slowdown * min(own, comm))]
        steps.append(_Step("compute", _gemm(shape, cal, (w - 1) * m_loc), (0,)))
        return simulate(steps)
    if sched.param("gemm") == "whole":  # pushed (own shard copied locally), then one GEMM
        # Every rank pushes its shard to its W - 1 peers one after another on one copy
        # stream, so (ranks being symmetric) the last shard lands after W - 1 pushes.
        local = cal.local_copy.time(shard_bytes) if cal.local_copy else 0.0
        return max((w - 1) * cal.p2p.time(shard_bytes), local) + _gemm(shape, cal, w * m_loc)
    s = min(sched.chunks, m_loc)
    if sched.name == "chunked":  # per piece: one all-gather of every rank's piece, then its GEMM
        comm = collective_time(cal, "all_gather", w * shard_bytes / s, w)
        gemm = _gemm(shape, cal, w * m_loc / s)
        steps = []
        for j in range(s):
            steps.append(_Step("comm", comm))
            overlapped = comm if j < s - 1 else 0.0  # the next piece's transfer runs beside it
            steps.append(_Step("compute", gemm + cal.collective_slowdown * min(gemm, overlapped), (len(steps) - 1,)))
        return simulate(steps)
    # GPU: own shard first (no wait), then the peers' pieces as the copy engine lands them.
    # par=1 runs the peers' GEMMs on a second compute stream: beside the own GEMM they share
    # its SMs, so the work adds up as queued here; what the second stream wins (the own GEMM's
    # last wave filled: 1-5% measured) is left to its own calibrated factor ("... :par=1").
    fused = 1.0 / fused_efficiency(shape.kind, sched, cal) if sched.name == "fused" else 1.0
    comm = cal.p2p.time(shard_bytes / s) * (1.0 + cal.transfer_slowdown)  # every push runs beside a GEMM
    own, piece = _gemm(shape, cal, m_loc) * fused, _gemm(shape, cal, m_loc / s) * fused
    # The copy engine slows the GEMMs only while it runs: charge the overlap once.
    interference = cal.overlap_slowdown * min(own + (w - 1) * s * piece, (w - 1) * s * comm)
    steps = [_Step("compute", own + interference)]
    for _ in range(w - 1):
        for _ in range(s):
            steps.append(_Step("comm", comm))
            steps.append(_Step("compute", piece, (len(steps) - 1,)))
    return simulate(steps)


# The fixed seconds of the low-latency all-reduces (kernels/gpu/lowlat.py) where the calibration
# has not timed them (lowlat_time adds the bytes moved): a kernel launch and two barriers of one
# flag round trip each over NVLink, a few microseconds as the published one-shot all-reduces
# report; two-shot passes its barriers with more work between.  Priors, not measurements here:
# `python -m torch_commopt calibrate` times them (Calibration.small_msg).
LOWLAT_PRIOR = {"oneshot": 4e-6, "twoshot": 6e-6}
# The low-latency buffer's two regions (lowlat.LL_CAP_BYTES each; a test ties the two), held once
# per group, and the largest product they take.
LOWLAT_CAP_BYTES = 16 << 20


def lowlat_time(cal: Calibration, name: str, full_bytes: float, world: int) -> float:
    """Seconds of a low-latency all-reduce (`oneshot`, `twoshot`) of a `full_bytes` product
    alone: measured (Calibration.small_msg) where it was, else the prior: LOWLAT_PRIOR's fixed
    part plus the bytes each rank moves over its links (one-shot: (W-1) products read; two-shot:
    2 (W-1)/W of one, read then written) at the copy-engine link's bandwidth."""
    measured = cal.small_message_time(name, full_bytes)
    if measured is not None:
        return measured
    moved = (world - 1) * full_bytes if name == "oneshot" else 2 * (world - 1) / world * full_bytes
    return LOWLAT_PRIOR[name] + moved / cal.p2p.bytes_per_s


def _reduce_time(shape: RegionShape, sched: Schedule, cal: Calibration) -> float:
    w, n = shape.world, shape.ns[0]
    m_seg = shape.rows / w
    full_bytes = shape.rows * n * shape.out_elt
    name = "all_reduce" if shape.kind == "matmul_ar" else "reduce_scatter"
    if sched.name in ("oneshot", "twoshot"):
        return _gemm(shape, cal, shape.rows) + lowlat_time(cal, sched.name, full_bytes, w)
    if sched.name == "sequential":
        small = cal.small_message_time("sequential", full_bytes) if shape.kind == "matmul_ar" else None
        return _gemm(shape, cal, shape.rows) + (small if small is not None else collective_time(cal, name, full_bytes, w))
    s = max(1, min(sched.chunks, int(m_seg)))
    if sched.name == "chunked":  # per piece: its GEMM, then its collective
        comm = collective_time(cal, name, full_bytes / s, w)
        gemm = _gemm(shape, cal, shape.rows / s)
        steps = []
        for j in range(s):
            overlapped = comm if j > 0 else 0.0  # the previous piece's collective runs beside it
            steps.append(_Step("compute", gemm + cal.collective_slowdown * min(gemm, overlapped)))
            steps.append(_Step("comm", comm, (len(steps) - 1,)))
        return simulate(steps)
    return _gpu_reduce_time(shape, sched, cal, m_seg, s)


def _gpu_reduce_time(shape: RegionShape, sched: Schedule, cal: Calibration, m_seg: float, s: int) -> float:
    """Peers' segments first (each piece shipped after its GEMM, or stored straight into
    the peer by `direct` / `fused:store=direct`), then the own segment piece by piece, each
    after the matching incoming pieces.  Ranks are symmetric, so a piece arrives when this
    rank's own outgoing piece of the same index would."""
    w = shape.world
    piece_bytes = m_seg / s * shape.ns[0] * shape.out_elt
    stores = sched.name == "direct" or (sched.name == "fused" and sched.param("store", "direct") == "direct")
    link = (cal.p2p_pull or cal.p2p) if sched.name == "ce_pull" else cal.p2p
    beside = 1.0 + cal.transfer_slowdown  # a partial's transfer runs beside the next GEMM
    # cuBLAS reductions at W = 2 move the received partial into the output on the local copy
    # stream (beside the GEMMs) before the GEMM adds into it; ce_pull pulls straight into the
    # output, fused adds in its epilogue.  (ce_push:1 at W = 2 and cuBLAS at W > 2: see below.)
    local_copy = cal.local_copy.time(piece_bytes) if cal.local_copy and sched.name in ("ce_push", "direct") else 0.0
    fused = 1.0 / fused_efficiency(shape.kind, sched, cal) if sched.name == "fused" else 1.0
    piece = _gemm(shape, cal, m_seg / s) * fused
    sent = (w - 1) * s
    if stores:  # epilogue stores over NVLink slow every peer piece
        peer_piece, interference = piece * (1.0 + cal.remote_store_slowdown), 0.0
    else:  # the copy engine slows the GEMMs only while it runs: charge the overlap once
        peer_piece = piece
        interference = cal.overlap_slowdown * min(w * s * piece, sent * beside * link.time(piece_bytes))
    steps, arrival, pushed = [], {c: [] for c in range(s)}, []
    for i in range(w - 1):
        for c in range(s):
            extra = interference if (i, c) == (0, 0) else 0.0
            steps.append(_Step("compute", peer_piece + extra))
            if not stores:
                steps.append(_Step("comm", beside * link.time(piece_bytes), (len(steps) - 1,)))
            arrival[c].append(len(steps) - 1)
    if (w == 2 and s == 1 and sched.name == "ce_push") or (w > 2 and sched.name != "fused"):
        # The own piece's GEMM first (no wait), then one pass adds the partials once the
        # peers' pieces are in: it reads W pieces and writes one (ce_push:1 at W = 2 adds the
        # partial after its GEMM; at W > 2 kernels/gpu/matmul_reduce._sum_slots).
        total = cal.local_copy.time((w + 1) / 2 * piece_bytes) if cal.local_copy else 0.0
        for c in range(s):
            steps.append(_Step("compute", piece))
            steps.append(_Step("compute", total, tuple(arrival[c])))
            pushed.append(_push_reduced_step(shape, cal, steps, piece_bytes, beside if c < s - 1 else 1.0))
        _gathered_copies(shape, sched, cal, steps, piece_bytes, pushed)
        return simulate(steps)
    own = piece + _sm90_partials(shape, sched, cal, piece_bytes)
    for c in range(s):
        if local_copy:
            steps.append(_Step("local", local_copy, tuple(arrival[c])))
            arrival[c] = [len(steps) - 1]
        steps.append(_Step("compute", own, tuple(arrival[c])))
        pushed.append(_push_reduced_step(shape, cal, steps, piece_bytes, beside if c < s - 1 else 1.0))
    _gathered_copies(shape, sched, cal, steps, piece_bytes, pushed)
    return simulate(steps)


def _sm90_partials(shape: RegionShape, sched: Schedule, cal: Calibration, piece_bytes: float) -> float:
    """What an own piece of the sm_90a reduce-scatter spends taking in and adding the peers'
    partials of it (Calibration.sm90_partial_bytes_per_s); 0 for every other schedule.  It scales
    with the segment's bytes, not with K: a short-K GEMM pays a larger share of its time."""
    if (shape.kind != "matmul_rs" or sched.name != "fused" or sched.param("impl") != "sm90"
            or cal.sm90_partial_bytes_per_s <= 0):
        return 0.0
    return (shape.world - 1) * piece_bytes / cal.sm90_partial_bytes_per_s


def _push_reduced_step(shape: RegionShape, cal: Calibration, steps: list[_Step], piece_bytes: float,
                       slowdown: float) -> int:
    """matmul_ar: the reduced piece just computed is pushed to every peer, its time times
    `slowdown` (1 + the transfer slowdown while the next piece's GEMM runs beside it, else 1);
    the index of the last push (-1 for matmul_rs)."""
    if shape.kind == "matmul_ar":
        push = cal.p2p.time(piece_bytes) * slowdown
        for _ in range(shape.world - 1):
            steps.append(_Step("comm", push, (len(steps) - 1,)))
        return len(steps) - 1
    return -1


def _gathered_copies(shape: RegionShape, sched: Schedule, cal: Calibration, steps: list[_Step],
                     piece_bytes: float, pushed: list[int]) -> None:
    """matmul_ar: each peer's reduced piece, landed in this rank's slot when its own push of the
    same piece ends (ranks are symmetric), is copied into the output on the local copy stream
    (`fused`: the side stream, after every push; matmul_reduce.matmul_ar_gpu)."""
    if shape.kind != "matmul_ar" or cal.local_copy is None:
        return
    queue = "comm" if sched.name == "fused" else "local"
    for last in pushed:
        for _ in range(shape.world - 1):
            steps.append(_Step(queue, cal.local_copy.time(piece_bytes), (last,)))


def extra_bytes(shape: RegionShape, sched: Schedule) -> int:
    """Device memory a call needs beyond its inputs and outputs: a GPU schedule's symmetric
    buffer (pool_bytes) and its staging, else the gathered input or the unreduced product."""
    w = shape.world
    if not sched.is_gpu:
        if shape.kind == "ag_matmul":
            return w * shape.rows * shape.k * shape.elt  # the gathered input
        return shape.rows * shape.ns[0] * shape.out_elt  # the unreduced product
    staging = 0
    if shape.kind != "ag_matmul" and (sched.name == "ce_push" or sched.param("store", "direct") == "ce"):
        staging = w * math.ceil(shape.rows / w) * shape.ns[0] * shape.out_elt
    return pool_bytes(shape, sched) + staging


def pool_bytes(shape: RegionShape, sched: Schedule) -> int:
    """The symmetric buffer a GPU schedule's call requests (both halves of W slots; what the
    kernels ask `GroupRuntime.buffer` for: ag_matmul.buffer_bytes, matmul_reduce.buffer_bytes).
    It is allocated once per size class and group and kept, so regions share it; the rest of
    extra_bytes is per call.  0 for the schedules without one."""
    if not sched.is_gpu:
        return 0
    if sched.name in ("oneshot", "twoshot"):
        return 2 * LOWLAT_CAP_BYTES  # the slot and the reduced region, whatever the message
    if shape.kind == "ag_matmul":
        return 2 * shape.world * shape.rows * shape.k * shape.elt  # twice the gathered input
    phases = 2 if shape.kind == "matmul_ar" else 1
    return 2 * phases * shape.world * math.ceil(shape.rows / shape.world) * shape.ns[0] * shape.out_elt


def candidates(shape: RegionShape, cal: Calibration, *, graphs: bool | str = False) -> list[Schedule]:
    """The schedules worth ranking for this region on this machine (graphs=True: for CUDA-graph
    replay, where a fused reduction would run as ce_push and is left out)."""
    out = [Schedule("sequential")] + [Schedule("chunked", s) for s in (2, 4, 8)]
    if shape.kind == "ag_matmul":
        out.append(Schedule("local_first"))
    if cal.p2p is None:
        return out
    gpu = [Schedule("ce_push", s) for s in (1, 2, 4)]
    if shape.kind == "ag_matmul":
        gpu += [Schedule("ce_push", 1, (("gemm", "whole"),)), Schedule("ce_push", 1, (("par", 1),))]
    else:
        gpu += [Schedule("direct", s) for s in (1, 2)] + ([] if shape.scaled else [Schedule("ce_pull", 2)])
    if shape.dtype in ("bfloat16", "float16"):
        gpu += [Schedule("fused", s) for s in (1, 4)]
    if shape.kind in ("ag_matmul", "matmul_rs") and shape.dtype == "bfloat16":
        gpu.append(Schedule("fused", 1, (("impl", "sm90"),)))  # the CUDA kernels (kernels/matmul/gpu/sm90.py)
    # the program's own graphs only: eager (or in per-call graphs, which they do not replay) a
    # Triton launch's host cost outweighs what they save
    if lowlat_fits(shape) and graphs is True:
        gpu += [Schedule("oneshot"), Schedule("twoshot")]
    # a schedule that runs as another one over this world (ce_pull over 3+ ranks), or replayed
    # inside a capture, would only repeat it
    return out + [s for s in gpu if s.valid_for(shape.kind) and s.at_world(shape.world) == s
                  and not (graphs and s.in_capture(shape.kind) != s)]


def lowlat_fits(shape: RegionShape) -> bool:
    """Whether the low-latency schedules take the region: an all-reduce of an unscaled product
    that fits their buffer, over at most LOWLAT_MAX_WORLD ranks."""
    return (shape.kind == "matmul_ar" and not shape.scaled and shape.world <= LOWLAT_MAX_WORLD
            and shape.rows * shape.ns[0] * shape.out_elt <= LOWLAT_CAP_BYTES)


def rank(shape: RegionShape, cal: Calibration, schedules: list[Schedule] | None = None, *,
         graphs: bool | str = False) -> list[Prediction]:
    """Predictions for the candidates, fastest first (ties: fewer bytes, then the name)."""
    preds = [predict(shape, s, cal, graphs=graphs) for s in (schedules or candidates(shape, cal, graphs=graphs))]
    return sorted(preds, key=lambda p: (p.seconds, p.extra_bytes, str(p.schedule)))
