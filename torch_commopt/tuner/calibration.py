"""Hardware parameters of the cost model: alpha-beta links, a GEMM fit, host costs.

A `Calibration` is what the model needs to know about one machine (device, world size,
topology, software versions).  It is measured by microbenchmarks on first use and kept
in the tuner cache; until a machine has been measured, `prior()` gives the figures
measured on the project's reference machines (docs/tuner.md), so the model can
rank candidates anywhere.  Every field round-trips through JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
# `graphs` of a region whose eager calls each replay their own CUDA graph (Config.call_graphs):
# truthy, so it is ranked as replayed (no per-call host cost), plus call_graph_slowdown.
PER_CALL = "call"


def replayed_as(cuda_graphs: bool, call_graphs: bool) -> bool | str:
    """A region's `graphs` for the model: True (the program replays its own CUDA graphs),
    PER_CALL (each eager call replays its own), else False."""
    return True if cuda_graphs else PER_CALL if call_graphs else False


@dataclass(kw_only=True, frozen=True)
class Link:
    """t(bytes) = alpha_s + bytes / bytes_per_s (one transfer or one collective step)."""

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bytes_per_s <= 0:
            raise ValueError(f"Link: alpha_s must be >= 0 and bytes_per_s > 0, got {self}")

    def time(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s


# The output tile gemm_occupancy counts (cuBLAS's Hopper kernels tile 128 x 128 to 256 x 128).
GEMM_TILE = 128


def gemm_occupancy(m: int, n: int, sms: int) -> float:
    """The share of `sms` SMs an m x n product's GEMM_TILE output tiles can occupy (1 without an
    SM count)."""
    if sms <= 0:
        return 1.0
    return min(1.0, -(-m // GEMM_TILE) * -(-n // GEMM_TILE) / sms)


@dataclass(kw_only=True, frozen=True)
class GemmFit:
    """A roofline: t(m, n, k) = launch_s + max(2mnk / peak_flops, (mk + kn + mn) / elems_per_s).
    A GEMM is bound either by its tensor cores or by streaming its operands and product through
    HBM once; whichever takes longer sets its time.  Splitting the rows of a compute-bound GEMM
    costs only the launches (4096 rows as two 2048-row GEMMs run 0-1% slower), while a thin
    one (a few hundred rows against an 8k x 8k weight) re-reads the whole weight and is
    memory-bound.  (On an H100, 810 TFLOP/s and 1.48e12 elements/s, i.e. ~3 TB/s of bf16, fit
    the five calibration samples within 1%.)

    sms > 0 (GPUs): a GEMM with fewer GEMM_TILE x GEMM_TILE output tiles than the device has SMs
    leaves the others idle, so its tensor-core rate is the occupied share of the peak (occupancy);
    two such GEMMs over the halves of the rows then take as long as the whole one (ag_matmul at
    M_global 512, K 8192, N_local 4096, replayed: two 256-row GEMMs (ce_push:1) take as long as
    one 512-row GEMM after the gather (gemm=whole), where the plain roofline prices each half at
    half the whole).  Replayed offline over the stored tuner runs (costmodel_replay.py --refit),
    it raises the model's top-1-within-5% count (430 against 422 of 476 picks), tiles of 128-160
    and a full machine at 0.75-1.0 x the SMs alike; 96 changes nothing, 256 loses.  The
    calibration samples fit a little worse with it (within 1.4% rather than 1.0%; docs/tuner.md,
    "Measurements behind the constants").

    elems_per_s = 0: the older form (stored calibrations, the priors), eff = d / (d + half_dim) with
    d = min(m, n, k), t = launch_s + 2mnk / (peak_flops * eff); it charges
    every split of a big GEMM (d 4096 -> 2048: ~4% at half_dim 170) what only thin ones pay."""

    peak_flops: float
    half_dim: float = 0.0
    launch_s: float
    elems_per_s: float = 0.0
    sms: int = 0

    def occupancy(self, m: int, n: int) -> float:
        return gemm_occupancy(m, n, self.sms)

    def time(self, m: int, n: int, k: int) -> float:
        if min(m, n, k) <= 0:
            return 0.0
        if self.elems_per_s > 0:
            compute = 2.0 * m * n * k / (self.peak_flops * self.occupancy(m, n))
            return self.launch_s + max(compute, (m * k + k * n + m * n) / self.elems_per_s)
        d = min(m, n, k)
        return self.launch_s + 2.0 * m * n * k / (self.peak_flops * d / (d + self.half_dim))


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """Everything the cost model knows about one machine.

    collective: NCCL (or gloo) ring collectives; a collective of a full tensor of n bytes
        over P ranks takes (P-1) steps of n/P bytes: t = (P-1) * link.time(n / P)
        (all_reduce: twice that).
    p2p: one copy-engine push into a peer's symmetric buffer; None where there is no
        symmetric memory (CPU).
    p2p_pull: one copy-engine pull from a peer's buffer, issued by the consumer after the
        producer's flag (its alpha includes that round trip).
    local_copy: a device-local copy (the C operand `addmm` copies into its output first).
    gemm: per dtype name ("bfloat16", "float16", "float32").
    gemm_samples: per dtype name, the [m, n, k, seconds] samples its fit came from (measured
        calibrations only; kept so a change of the fit can be judged offline).
    host_s: host time of one op call per schedule family (Python, dispatch, launches), and
        per op and family where measured ("matmul_rs ce_push"); back-to-back calls take
        max(GPU time, host time).
    host_per_piece_s: extra host time per piece of a chunked / GPU schedule.
    host_per_piece_by_kind: {kind: the same} for the ops whose GPU schedules were probed at two
        piece counts (the reductions: calibrate._per_piece_by_kind); the others take
        host_per_piece_s (`per_piece`).
    overlap_slowdown: GEMM slowdown while a copy-engine transfer runs beside it, as a
        fraction of the transfer's time (t = gemm + slowdown * min(gemm, transfer)).
    collective_overlap_slowdown: the same for a collective of the process group (NCCL
        kernels take SMs from the GEMM; on a CPU, gloo's threads take cores); None: as
        overlap_slowdown.
    remote_store_slowdown: GEMM slowdown when its epilogue stores into a peer (direct).
    transfer_slowdown: a copy-engine transfer's slowdown while cuBLAS GEMMs run beside it
        (the transfer's time there is (1 + slowdown) times its time alone): one push to the
        peer timed on its own stream, alone and with GEMMs throughout (calibrate._push_timings).
        0 where not measured.
    fused_efficiency: Triton persistent GEMM speed relative to cuBLAS.
    sm90_efficiency: {kind: speed relative to cuBLAS} of the sm_90a fused kernels (`impl=sm90`,
        kernels/matmul/gpu/sm90.py) for ag_matmul and matmul_rs, their GEMM and stores alone
        (the reduce-scatter's reduction is sm90_partial_bytes_per_s's); a kind not here takes
        fused_efficiency.
    sm90_partial_bytes_per_s: the rate at which the sm_90a reduce-scatter's own tiles take in and
        add a peer's partial, in the partial's bytes: the own segment's (world - 1) partials cost
        their bytes over this on top of its GEMM (0: not charged).
    schedule_factor: {"kind family" or "kind family:S": measured / predicted device time} of each schedule
        family on a probe shape (probe_factors._schedule_probes): what the pipeline model
        leaves out (flag round trips, the order the streams really run in, a family's
        own inefficiencies), applied to that family's predicted device time.
    attention_flops: {dtype name: flop/s} of the local attention kernel (kernels/attention/local.py's
        `auto` pick) on a block of the calibration shape, forward; attention_bwd_factor: its
        backward's time over the forward's (0: not known; the attention model then uses its
        defaults).
    schedule_factor_curve: {"kind family": [[predicted device s, factor], ...]} from probes of
        different lengths (a short one timed as CUDA-graph replays, the long one above); a
        family with two points or more takes its factor interpolated in log(predicted
        time), clamped to the end points (`factor`): one factor measured on a long shape
        over-predicts ce_push:2 by ~17% at M_global 2048.
    schedule_factor_curve_graphs: the same with the long probe timed as CUDA-graph replays
        too, for calls replayed from graphs (`factor(graphs=True)`).  An eager long probe of a
        many-piece schedule is partly host-bound, and its factor then charges host time as
        device time (matmul_ar ce_push:4 calibrated at 1.70 eagerly would put it replayed at
        1.37 ms at 8192^3, where it runs 0.885, the best there).
    call_graph_slowdown: {"kind family:S", "kind family" or "kind": time of back-to-back calls each
        replayed from its own CUDA graph (Config.call_graphs, cg=1) over the same calls
        replayed from one graph}, from the short probes timed both ways: applied on top of the
        replayed factor where a region runs per-call graphs (`factor(graphs=PER_CALL)`).  The
        per-call replays cost each schedule differently: the all-reduce at M_global 2048 runs
        ce_pull:2 ~15% slower per call than replayed, ce_push:2 ~7%, so the replayed ranking
        alone picks ce_pull:2 where ce_push:2 is the best (docs/tuner.md).
    eager_over_replayed: the long probes' eager time over their replayed time, the median over
        the schedules probed both ways (0: not measured).  Where it is known, an eager call's
        device factor is the replayed curve times it (`factor`): a probe that runs near its
        host cost reads eagerly what the host adds, which the model charges apart (max(GPU,
        host)); taken into the device factor, it goes on to shapes whose host hides behind the
        GPU.  The eager long probe spreads more between calibrations than the replayed one (RS
        ce_pull:2: 0.756-0.832 ms against 0.720-0.736), and a high read ranks a schedule 8-10%
        behind first at RS 16384 x 8192 x {8192, 7168}.
    gemm_table: {"dtype m n k": seconds} of GEMMs timed at their own shapes (tuner.gemm_table):
        the model prices a GEMM it holds at that figure and the others with the fit
        (`gemm_time`).  cuBLAS's efficiency moves with a shape's tiling in ways a roofline
        cannot follow: timed alone on an H100, the reduce-scatter probe's 3072-row quarters
        (K 3072, N 6144) take 3.9% longer than its halves, the sweep's 4096-row quarters
        (K 4096, N 8192) 1.6% less, so without the table the probe factors of the four-piece
        schedules carry a penalty to shapes that do not pay it.
    small_msg: {"sequential" | "oneshot" | "twoshot": [[bytes, seconds], ...]} the all-reduce of a
        small product alone (its GEMM's time taken out), timed as CUDA-graph replays of back-to-back
        calls (calibrate._small_message_times): NCCL's latency at a few KB is its protocol's, not
        the ring's alpha-beta fitted at MBs, and the low-latency kernels have no ring at all.  Read
        by `small_message_time`; empty: the model's priors (model.LOWLAT_PRIOR).
    """

    device: str
    world: int
    collective: dict[str, Link]
    p2p: Link | None = None
    p2p_pull: Link | None = None
    local_copy: Link | None = None
    gemm: dict[str, GemmFit] = field(default_factory=dict)
    gemm_samples: dict[str, list[list[float]]] = field(default_factory=dict)
    host_s: dict[str, float] = field(default_factory=dict)
    host_per_piece_s: float = 0.0
    host_per_piece_by_kind: dict[str, float] = field(default_factory=dict)
    overlap_slowdown: float = 0.0
    collective_overlap_slowdown: float | None = None
    remote_store_slowdown: float = 0.0
    transfer_slowdown: float = 0.0
    fused_efficiency: float = 1.0
    sm90_efficiency: dict[str, float] = field(default_factory=dict)
    sm90_partial_bytes_per_s: float = 0.0
    schedule_factor: dict[str, float] = field(default_factory=dict)
    schedule_factor_curve: dict[str, list[list[float]]] = field(default_factory=dict)
    schedule_factor_curve_graphs: dict[str, list[list[float]]] = field(default_factory=dict)
    call_graph_slowdown: dict[str, float] = field(default_factory=dict)
    gemm_table: dict[str, float] = field(default_factory=dict)
    eager_over_replayed: float = 0.0
    attention_flops: dict[str, float] = field(default_factory=dict)
    attention_bwd_factor: float = 0.0
    small_msg: dict[str, list[list[float]]] = field(default_factory=dict)
    source: str = "prior"  # "prior" or "measured"
    measured: tuple[str, ...] = ()  # the fields a measurement set; the rest are the prior's
    remeasured: tuple[str, ...] = ()  # figures whose two passes disagreed: a third decided (calibrate.agreed)

    def __post_init__(self) -> None:
        missing = [c for c in COLLECTIVES if c not in self.collective]
        if missing:
            raise ValueError(f"Calibration.collective: missing {missing}")
        if self.world < 1:
            raise ValueError(f"Calibration.world: must be >= 1, got {self.world}")
        object.__setattr__(self, "measured", tuple(self.measured))
        object.__setattr__(self, "remeasured", tuple(self.remeasured))

    def gemm_fit(self, dtype: str) -> GemmFit:
        if dtype in self.gemm:
            return self.gemm[dtype]
        if not self.gemm:
            raise ValueError(f"Calibration for {self.device}: no GEMM fit at all")
        return next(iter(self.gemm.values()))

    def gemm_time(self, dtype: str, m: int, n: int, k: int) -> float:
        """Seconds of one m x n x k GEMM: its timed figure where the table holds one, else the fit."""
        timed = self.gemm_table.get(gemm_key(dtype, m, n, k))
        return timed if timed is not None else self.gemm_fit(dtype).time(m, n, k)

    @property
    def collective_slowdown(self) -> float:
        return self.overlap_slowdown if self.collective_overlap_slowdown is None else self.collective_overlap_slowdown

    def factor(self, key: str, predicted_s: float, *, graphs: bool | str = False) -> float:
        """The model correction of `key` ("kind family:S", else "kind family") at a predicted
        device time: a piece count probed on its own has its own factor (splitting a cuBLAS
        GEMM costs what the GEMM fit does not see), the others take their family's.
        graphs=True (calls replayed from CUDA graphs): the replay-timed curve where there is one;
        eager calls: that curve times eager_over_replayed where both are known, else the eager one;
        graphs=PER_CALL (each call replayed from its own graph): that, times the key's (else its
        family's, else its op's) call_graph_slowdown."""
        if graphs == PER_CALL:
            slowdown = next((self.call_graph_slowdown[k] for k in (key, key.split(":")[0], key.split(" ")[0])
                             if k in self.call_graph_slowdown), 1.0)
            return self.factor(key, predicted_s, graphs=True) * slowdown
        if graphs or self.eager_over_replayed > 0:  # eagerly: the replayed curve times the eager overhead
            scale = 1.0 if graphs else self.eager_over_replayed
            for k in (key, key.split(":")[0]):
                if len(self.schedule_factor_curve_graphs.get(k, ())) >= 2:
                    return _interpolate(sorted(self.schedule_factor_curve_graphs[k]), predicted_s) * scale
        if key not in self.schedule_factor and key not in self.schedule_factor_curve:
            key = key.split(":")[0]
        curve = sorted(self.schedule_factor_curve.get(key, ()))
        if len(curve) < 2 or predicted_s <= 0:
            return self.schedule_factor.get(key, 1.0)
        return _interpolate(curve, predicted_s)

    def small_message_time(self, name: str, nbytes: float) -> float | None:
        """Seconds of an all-reduce of `nbytes` by `name` from small_msg: interpolated in log-log
        between its samples; below the smallest, the smallest's (latency-bound); above the largest,
        None (the bandwidth-bound models take over).  None where `name` was not measured."""
        curve = sorted(self.small_msg.get(name, ()))
        if not curve or nbytes > curve[-1][0]:
            return None
        if nbytes <= curve[0][0]:
            return curve[0][1]
        x = math.log(nbytes)
        for (ba, ta), (bb, tb) in zip(curve, curve[1:]):
            if nbytes <= bb:
                w = (x - math.log(ba)) / max(math.log(bb) - math.log(ba), 1e-12)
                return math.exp(math.log(ta) + w * (math.log(tb) - math.log(ta)))
        return None

    def per_piece(self, kind: str) -> float:
        """Host seconds per piece of a `kind` call: its own figure where measured, else the shared one."""
        return self.host_per_piece_by_kind.get(kind, self.host_per_piece_s)

    def host(self, family: str, kind: str | None = None) -> float:
        """Host seconds of one call of a `family` schedule: op `kind`'s own figure where it was
        measured ("matmul_rs ce_push"), else the family's, else "default"."""
        if kind is not None and f"{kind} {family}" in self.host_s:
            return self.host_s[f"{kind} {family}"]
        return self.host_s.get(family, self.host_s.get("default", 0.0))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        raw = json.loads(text)
        raw["collective"] = {k: Link(**v) for k, v in raw["collective"].items()}
        for name in ("p2p", "p2p_pull", "local_copy"):
            raw[name] = Link(**raw[name]) if raw.get(name) else None
        raw["gemm"] = {k: GemmFit(**v) for k, v in raw.get("gemm", {}).items()}
        return cls(**raw)


def gemm_key(dtype: str, m: int, n: int, k: int) -> str:
    """Calibration.gemm_table's key of a GEMM."""
    return f"{dtype} {m} {n} {k}"


def _interpolate(curve: list[list[float]], predicted_s: float) -> float:
    """A factor curve's value at a predicted time: linear in log(time) between its points,
    clamped to its end points (curve sorted by time, two points or more)."""
    if predicted_s <= 0:
        return curve[0][1]
    x = math.log(predicted_s)
    if x <= math.log(curve[0][0]):
        return curve[0][1]
    for (ta, fa), (tb, fb) in zip(curve, curve[1:]):
        if x <= math.log(tb):
            w = (x - math.log(ta)) / max(math.log(tb) - math.log(ta), 1e-12)
            return fa + w * (fb - fa)
    return curve[-1][1]


def prior(device: str, world: int) -> Calibration:
    """Figures measured on the reference machines, for a machine not yet calibrated.
    Any CUDA device gets the H200 figures (2x H200 NV18, torch 2.11, docs/tuner.md):
    NCCL all-gather of 128 MiB per rank ~0.6 ms, copy-engine push ~390 GB/s (pull ~367),
    a 64 MiB device-local copy ~30 us, bf16 GEMM
    ~750 TFLOP/s on 8k shapes, host ~100 us (NCCL path) to ~150-300 us (GPU schedules)."""
    if device == "cpu":
        return _cpu_prior(world)
    nccl = Link(alpha_s=8e-6, bytes_per_s=230e9)
    bf16 = GemmFit(peak_flops=760e12, half_dim=48.0, launch_s=6e-6)
    return Calibration(
        device=device, world=world,
        collective={c: nccl for c in COLLECTIVES},
        p2p=Link(alpha_s=6e-6, bytes_per_s=390e9),
        p2p_pull=Link(alpha_s=20e-6, bytes_per_s=150e9),
        local_copy=Link(alpha_s=3e-6, bytes_per_s=2.2e12),
        gemm={"bfloat16": bf16, "float16": bf16,
              "float32": GemmFit(peak_flops=50e12, half_dim=48.0, launch_s=6e-6)},
        host_s={"sequential": 100e-6, "chunked": 120e-6, "local_first": 110e-6, "ce_push": 140e-6, "ce_pull": 160e-6,
                "direct": 130e-6, "fused": 160e-6},
        host_per_piece_s=25e-6, overlap_slowdown=0.09, remote_store_slowdown=0.12,
        # an NCCL collective beside cuBLAS barely overlaps (calibrated 0.71-0.87 on 2x H200)
        collective_overlap_slowdown=0.8,
        fused_efficiency=0.87,
        # the sm_90a kernels back to back against cuBLAS at the training step's GEMMs, one H200:
        # all-gather 0.98-1.01; the reduce-scatter alone at world 1 (no partial) 0.975-0.994, and
        # with the partial 11 us more at both wo and w2, a 32 MiB own segment each
        # (docs/gpu-schedules.md)
        sm90_efficiency={"ag_matmul": 0.99, "matmul_rs": 0.985}, sm90_partial_bytes_per_s=3.0e12,
        # cuDNN attention on one H200, B1 H32 D128 bf16, 16K-64K (docs/context-parallel-attention.md)
        attention_flops={"bfloat16": 600e12, "float16": 600e12}, attention_bwd_factor=2.75,
    )


def _cpu_prior(world: int) -> Calibration:
    """gloo on a small CPU machine: slow links, a few hundred GFLOP/s, cheap host side."""
    gloo = Link(alpha_s=60e-6, bytes_per_s=2e9)
    fp32 = GemmFit(peak_flops=100e9, half_dim=16.0, launch_s=5e-6)
    return Calibration(
        device="cpu", world=world,
        collective={c: gloo for c in COLLECTIVES},
        gemm={"float32": fp32, "bfloat16": GemmFit(peak_flops=30e9, half_dim=16.0, launch_s=5e-6)},
        host_s={"sequential": 40e-6, "chunked": 60e-6, "local_first": 60e-6},
        host_per_piece_s=20e-6, overlap_slowdown=0.6,
    )
