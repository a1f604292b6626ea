"""The built-in schedule rule for CUDA regions (the tuner's `mode="model"` / `"autotune"` replace it).

Pure arithmetic on shapes: importable without CUDA, so the compile-time pass can call it.
It estimates the GEMM time and the transfer time of a region with round ceilings of an
H200 pair (NVLink copy ~300 GB/s one way; bf16 GEMM ~700 TFLOP/s achieved) and picks
(short replayed all-gathers and long all-gathers above two ranks are treated apart in pick()):
- `sequential` (NCCL + cuBLAS) when the shape is not one the GPU schedules take, or
  when the transfer is too small to be worth hiding (fixed costs -- a barrier, flag
  round trips, a second GEMM launch -- would exceed what overlap can save);
- otherwise the GPU schedule that runs fastest on the benchmark shapes, by GEMM length.
The thresholds and the measurements behind them: docs/gpu-schedules.md, "The built-in rule".
"""

from __future__ import annotations

import math

from torch_commopt.core.schedule import Schedule

LINK_BYTES_PER_S = 300e9
GEMM_FLOPS_PER_S = {"bfloat16": 700e12, "float16": 700e12, "float32": 50e12,
                    "float8_e4m3fn": 1400e12, "float8_e5m2": 1400e12}  # float8: Hopper's 2x peak
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
# Below this estimated transfer time the fixed costs of an overlapped schedule win.
MIN_HIDDEN_COMM_S = 20e-6
# Under CUDA-graph replay only the GPU-side fixed costs remain (flag round trips, a second
# GEMM launch): a few microseconds.
MIN_HIDDEN_COMM_S_GRAPHS = 5e-6
# Below this estimated GEMM time an eager call is host-bound and NCCL + cuBLAS wins: a GPU
# schedule's call enqueues more host work than NCCL's, even with its side-stream work queued by
# driver calls (kernels/gpu/driver.py; docs/gpu-schedules.md, "Host cost"), so at M_global 512
# (est. 0.05 ms) ce_push:1 runs 0.19-0.22 ms a call against NCCL's 0.08-0.09 on every host.
MIN_GEMM_S = 0.1e-3
# Replayed reductions: below this GEMM time NCCL's latency-optimal small collectives win.
MIN_GEMM_S_GRAPHS = 0.1e-3
# Replayed all-gathers and reduce-scatters at W > 2 below MIN_GEMM_S_GRAPHS: under this,
# NCCL + cuBLAS; above, ce_push:1 (for all-gathers gemm=whole, the W = 2 choice, loses to NCCL
# at 4 ranks; see pick()).
SHORT_GRAPHS_WIDE_S = 0.05e-3
# Eager calls between MIN_GEMM_S and SHORT_GEMM_S of estimated GEMM: whether ce_push:1 or
# NCCL + cuBLAS wins depends on the host's speed, which varies 2x between hosts of one
# kind, so the rule names both to time at the region's first call (tuner.autotune) instead
# of guessing (M_global 2048, est. 0.2 ms: ce_push:1 ~0.7x NCCL's time on a fast host, up to
# 1.6x on a slow one).  A first-call measurement can still mislead when the host's speed
# changes after it, hence the margin in favour of NCCL (tuner.autotune.BAND_MARGIN).
# Reduce-scatters also time direct:1 (the partial stored straight into the peer's output, no
# staging copy): it and ce_push:1 lead each other by turns at M_global 2048 from run to run.
# Figures: docs/gpu-schedules.md, "The built-in rule".
BAND_CANDIDATES = {"ag_matmul": ["sequential", "ce_push:1"], "matmul_rs": ["sequential", "ce_push:1", "direct:1"],
                   "matmul_ar": ["sequential", "ce_push:1"]}
# Replayed all-reduces of a product of at most LOWLAT_BAND_BYTES (a decoder's row-parallel
# projections, a few KB a token, up to prefill-sized chunks): the low-latency schedules
# (kernels/gpu/lowlat.py: one launch after the GEMM, the partials read straight from the peers'
# slots) and NCCL are timed against each other as graph replays at the first call, with the rule's
# own pick where it is another schedule (the rule cannot tell from the shape how the card's NVLink
# latency, NCCL's protocol choice and the kernel's launch compare); under a capture, and until
# measured, the rule's pick runs.  The band is the low-latency buffer (lowlat.LL_CAP_BYTES): with
# 16-byte loads the one-shot kernel is not only a latency play (2x H200, bf16: 1.13-1.47x NCCL at
# 1-8 MiB products, benchmarks/results/decode_gemm_ar_h200x2_*.md).
LOWLAT_BAND_BYTES = 16 << 20
LOWLAT_CANDIDATES = ["sequential", "oneshot", "twoshot"]
LOWLAT_DTYPES = ("bfloat16", "float16", "float32")
LOWLAT_MAX_WORLD = 8  # one NVLink host's GPUs: the band is not for wider groups (unmeasured there)
# Replayed two-rank bf16 / fp16 all-gathers under MIN_GEMM_S_GRAPHS: the two kinds of card
# order the GPU schedules differently, so the first call times them as graph replays: at
# M_global 512, K = N = 8192 (est. 49 us), H200 runs ce_push:1:par=1 ~6% ahead of gemm=whole
# and H100 ~5% behind it (two GEMMs, each reading the whole 64 MiB weight, side by side);
# docs/gpu-schedules.md, "The built-in rule".
REPLAYED_BAND_CANDIDATES = {"ag_matmul": ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]}
# The band's upper end: above it a GPU schedule's GEMM outlasts its host cost even on a slow
# host (RS 8192^3, est. 0.79 ms: ce_push:1 1.10-1.15x the best baseline eager there).
SHORT_GEMM_S = 0.5e-3
# All-gathers at two ranks whose GEMM is estimated in [SHORT_GEMM_S, PAR_MAX_GEMM_S) run the
# peer's GEMM on a second compute stream beside the own shard's (ce_push:1:par=1): it fills
# the own GEMM's last wave instead of queueing behind it (0.3-4.7% ahead of ce_push:1 at
# 8192^3, 16384x8192^2 and 4096x8192x28672).  Above PAR_MAX_GEMM_S the two GEMMs only share
# the SMs (16384x8192x28672, est. 5.5 ms: 1.0-1.4% behind).  docs/gpu-schedules.md, "The
# built-in rule".
PAR_MAX_GEMM_S = 3e-3
# Replayed, par=1 pays from here (no host cost to stand against the second stream's event):
# at M_global 2048 (K = N = 8192, est. 0.19 ms) ce_push:1:par=1 runs ~3% ahead of ce_push:1 on
# both H100 and H200.  Below it (M_global 512, est. 49 us) the cards part (see
# REPLAYED_BAND_CANDIDATES): gemm=whole is the rule's pick there, and at two ranks the first
# call times both.
PAR_MIN_GEMM_S_GRAPHS = 0.1e-3
# Reductions run ce_push:1 below this estimated GEMM time, ce_push:2 above (see pick()).
SHORT_REDUCE_S = {"matmul_rs": 1.0e-3, "matmul_ar": 0.5e-3}
# Two-rank bf16 / fp16 reduce-scatters, whose received partial is added in place, run two pieces
# from here (ce_pull:2, see pick()).  Float8 ones sum their partials in one pass after the GEMM and
# wider groups sum W slots, so a second piece only adds a GEMM tail under SHORT_REDUCE_S: they
# keep it (rs 16384x8192x7168, est. 0.69 ms: ce_push:1 7-10% ahead of :2 at W = 4, ~3% in
# float8 at W = 2; docs/gpu-schedules.md, "Measurements behind the constants").
IN_PLACE_RS_S = 0.5e-3


def call_graphs_pay(kind: str, a_shape: list[int], weight_shapes: list[list[int]], world: int, dtype: str,
                    longer: bool = False) -> bool:
    """Whether an eager region's calls should replay per-call CUDA graphs (Config.call_graphs):
    its GEMM is estimated in [MIN_GEMM_S, SHORT_GEMM_S), the band where an eager call's host
    cost decides between a GPU schedule and NCCL (there a replayed call runs ~0.7-0.9x NCCL's
    time, docs/gpu-schedules.md, "Per-call CUDA graphs").  Below MIN_GEMM_S the replayed call
    still pays ~0.1 ms of host (the op's dispatch, its key, the graph launch) against ~0.08 of
    GPU, so NCCL + cuBLAS stay.  Longer regions hide their host cost behind the GEMM, and a
    graph would only hold memory for their (large) staging tensors while running no faster.
    longer (Config.call_graphs="all"): the longer regions too, for a step whose host, not its
    GPU, decides (their host cost is hidden behind the GEMM only while the host runs ahead)."""
    gemm_s = estimate(kind, a_shape, [w[-1] for w in weight_shapes], world, dtype)[0]
    return MIN_GEMM_S <= gemm_s and (longer or gemm_s < SHORT_GEMM_S)


def estimate(kind: str, a_shape: list[int], ns: list[int], world: int, dtype: str) -> tuple[float, float]:
    """(gemm seconds, transfer seconds) of one rank for a region."""
    rows, k = math.prod(a_shape[:-1]), a_shape[-1]
    elt = ELEMENT_BYTES.get(dtype, 4)
    if kind != "ag_matmul" and dtype.startswith("float8"):
        elt = 2  # a reduction moves the product: a float8 one comes out in bf16 / fp16
    if kind == "ag_matmul":
        flops = 2 * world * rows * k * sum(ns)
        moved = (world - 1) * rows * k * elt
    elif kind == "matmul_rs":
        flops = 2 * rows * k * ns[0]
        moved = (world - 1) * rows // world * ns[0] * elt
    else:  # all-reduce: reduce-scatter + all-gather of the product
        flops = 2 * rows * k * ns[0]
        moved = 2 * (world - 1) * rows // world * ns[0] * elt
    return flops / GEMM_FLOPS_PER_S.get(dtype, 50e12), moved / LINK_BYTES_PER_S


def measure_band(kind: str, a_shape: list[int], weight_shapes: list[list[int]], dim: int | None, world: int,
                 dtype: str, *, graphs: bool = False) -> list[str] | None:
    """Candidates to time at the first call when the rule cannot tell from the shape alone
    (an eager call in the host-bound band, see BAND_CANDIDATES; a replayed short two-rank
    all-gather, see REPLAYED_BAND_CANDIDATES: timed as replays, by GPU time), else None."""
    if graphs is True and lowlat_band(kind, a_shape, weight_shapes, world, dtype):
        rule = str(_rule(kind, a_shape, weight_shapes, dim, world, dtype, graphs=True)[0])
        return list(LOWLAT_CANDIDATES) + ([rule] if rule not in LOWLAT_CANDIDATES else [])
    if gpu_refusal(kind, a_shape, weight_shapes, dim, world) is not None:
        return None
    gemm_s, comm_s = estimate(kind, a_shape, [w[-1] for w in weight_shapes], world, dtype)
    if graphs:
        short = comm_s >= MIN_HIDDEN_COMM_S_GRAPHS and gemm_s < MIN_GEMM_S_GRAPHS
        if kind in REPLAYED_BAND_CANDIDATES and world <= 2 and short and dtype in ("bfloat16", "float16"):
            return list(REPLAYED_BAND_CANDIDATES[kind])
        return None
    if kind not in BAND_CANDIDATES or comm_s < MIN_HIDDEN_COMM_S or not MIN_GEMM_S_GRAPHS <= gemm_s < SHORT_GEMM_S:
        return None
    if kind == "matmul_ar" and dtype.startswith("float8"):
        # a float8 all-reduce's bf16 product moves as long as against half the GEMM: two pieces
        # may pay eager too (at M_global 8192 ce_push:2 leads on H200 and trails on H100), so
        # the first call times them both
        return BAND_CANDIDATES[kind] + ["ce_push:2"]
    return list(BAND_CANDIDATES[kind])


def lowlat_band(kind: str, a_shape: list[int], weight_shapes: list[list[int]], world: int, dtype: str) -> bool:
    """Whether a region is a small all-reduce the low-latency schedules take (LOWLAT_BAND_BYTES;
    whether its calls are replayed is the caller's to check).  Any row count: the kernels split
    no rows over the ranks."""
    if kind != "matmul_ar" or dtype not in LOWLAT_DTYPES or not 2 <= world <= LOWLAT_MAX_WORLD:
        return False
    if len(weight_shapes) != 1 or len(weight_shapes[0]) != 2:
        return False
    return math.prod(a_shape[:-1]) * weight_shapes[0][-1] * ELEMENT_BYTES[dtype] <= LOWLAT_BAND_BYTES


def gpu_refusal(kind: str, a_shape: list[int], weight_shapes: list[list[int]], dim: int | None, world: int) -> str | None:
    """Why no GPU schedule can take a region of this shape (the kernels' own checks), or None."""
    if any(len(w) != 2 for w in weight_shapes):
        return "batched weights"
    if dim is not None and dim == len(a_shape) - 1:
        return "collective on the last dim"
    if kind != "ag_matmul" and math.prod(a_shape[:-1]) % world:
        return "rows do not split evenly"
    return None


def pick(kind: str, a_shape: list[int], weight_shapes: list[list[int]], dim: int | None, world: int,
         dtype: str, *, graphs: bool = False) -> tuple[Schedule, str]:
    """(schedule, why) for a region running on CUDA.  graphs=True: the calls are replayed
    from a CUDA graph (Config.cuda_graphs), so the host cost that makes short GEMMs run
    `sequential` in eager mode is not paid; only the GPU-side fixed costs count."""
    if graphs is True and lowlat_band(kind, a_shape, weight_shapes, world, dtype):
        nbytes = math.prod(a_shape[:-1]) * weight_shapes[0][-1] * ELEMENT_BYTES[dtype]
        sched, why = _rule(kind, a_shape, weight_shapes, dim, world, dtype, graphs=True)
        return sched, (f"{why}; replayed all-reduce of {nbytes / 1024:.0f} KiB: this until measured "
                       "against the low-latency schedules")
    return _rule(kind, a_shape, weight_shapes, dim, world, dtype, graphs=graphs)


def _rule(kind: str, a_shape: list[int], weight_shapes: list[list[int]], dim: int | None, world: int,
          dtype: str, *, graphs: bool = False) -> tuple[Schedule, str]:
    """pick() outside the low-latency band: the rule from the shape alone."""
    refusal = gpu_refusal(kind, a_shape, weight_shapes, dim, world)
    if refusal is not None:
        return Schedule("sequential"), refusal + ": NCCL + cuBLAS"
    gemm_s, comm_s = estimate(kind, a_shape, [w[-1] for w in weight_shapes], world, dtype)
    why = f"est. gemm {gemm_s * 1e6:.0f} us, transfer {comm_s * 1e6:.0f} us"
    if dtype.startswith("float8") and world <= 2:
        picked = _float8_pick(kind, gemm_s, comm_s, graphs)
        if picked is not None:
            return Schedule.parse(picked[0]), why + ": " + picked[1]
    if comm_s < (MIN_HIDDEN_COMM_S_GRAPHS if graphs else MIN_HIDDEN_COMM_S):
        return Schedule("sequential"), why + ": too little to hide"
    if gemm_s < MIN_GEMM_S and not graphs:
        return Schedule("sequential"), why + ": too short to pay a GPU schedule's host cost"
    if kind == "ag_matmul":
        if graphs and gemm_s < MIN_GEMM_S_GRAPHS:
            if world <= 2:
                # Replayed short all-gathers: one GEMM over the gathered rows once they are all
                # in, since a second GEMM launch costs more than the overlap saves (M_global
                # 512, K = N = 8192: gemm=whole ahead of or tied with ce_push:1 and NCCL).
                return Schedule.parse("ce_push:1:gemm=whole"), why + ": short GEMM, one GEMM after the gather"
            # Over more than one peer the whole GEMM waits for the last of W - 1 shards, so
            # gemm=whole loses to NCCL; below SHORT_GRAPHS_WIDE_S NCCL also beats ce_push:1,
            # above it ce_push:1 leads (4 ranks, K = N = 8192: M_global 512 NCCL ahead by ~25%,
            # M_global 2048 ce_push:1 ahead by ~8%).
            if gemm_s < SHORT_GRAPHS_WIDE_S:
                return Schedule("sequential"), why + f": short GEMM over {world - 1} peers' shards, NCCL + cuBLAS"
            return Schedule("ce_push", 1), why + f": short GEMM over {world - 1} peers' shards, one piece each"
        if world > 2 and gemm_s >= SHORT_GEMM_S and dtype in ("bfloat16", "float16"):
            # More than one peer: cuBLAS runs W GEMMs of M/W rows each, the fused persistent
            # kernel one pass over every tile as its rows land: at 4 ranks fused:2:tma=1 runs
            # 1-16% ahead of ce_push:1 from 16384x8192x8192 up to 4096x8192x28672 (ties at
            # 16384x8192x28672).  Under SHORT_GEMM_S the two trade places, and ce_push:1 stays.
            # docs/gpu-schedules.md, "Measurements behind the constants".
            return Schedule.parse("fused:2:tma=1"), why + f": {world - 1} peers, one fused pass over the tiles"
        if world <= 2 and (PAR_MIN_GEMM_S_GRAPHS if graphs else SHORT_GEMM_S) <= gemm_s < PAR_MAX_GEMM_S:
            return Schedule.parse("ce_push:1:par=1"), why + ": the peer's GEMM beside the own shard's (par=1)"
        # One piece: the peer's shard lands long before the own shard's GEMM ends, and more
        # pieces only add GEMM tails (16384x8192x28672: ce_push:1 ~0.5% ahead of :4).
        return Schedule("ce_push", 1), why
    if graphs and gemm_s < MIN_GEMM_S_GRAPHS:
        if kind == "matmul_rs" and world > 2 and gemm_s >= SHORT_GRAPHS_WIDE_S:
            # Over more than one peer NCCL's reduce-scatter moves W - 1 pieces after the whole
            # GEMM; ce_push:1 ships each peer's piece as soon as its GEMM ends.  4 ranks,
            # replayed, K = N = 8192: M_global 2048 (est. 98 us) ce_push:1 ~11% ahead of NCCL;
            # M_global 512 (est. 25 us) NCCL ahead.  The all-reduce keeps NCCL (~9% ahead at
            # M_global 2048).
            return Schedule("ce_push", 1), why + f": short GEMM, {world - 1} peers' pieces shipped as they end"
        # Replayed: at M_global 512 NCCL + cuBLAS beat every reduction schedule (direct:1,
        # the closest, ~7% behind).
        return Schedule("sequential"), why + ": short reduction, GPU-side fixed costs exceed the overlap"
    if not graphs and gemm_s < SHORT_GEMM_S and kind == "matmul_ar":
        # (inside the band: the fallback when the first-call measurement cannot run)
        return Schedule("sequential"), why + ": short GEMM, all-reduce ties NCCL eager"
    # One piece while the GEMM is short: the own GEMM runs first and the peer's partial is
    # added after it, and a second piece only adds a GEMM tail (rs 2048, rs 4096x8192x7168 and
    # ar 2048: ce_push:1 3-13% ahead of :2).  Longer GEMMs hide the last transfer better in two
    # pieces (rs 16384x8192^2, ar 8192^3, and rs 8192^3 now that the copy of the first received
    # partial does not wait for this rank's own peer GEMMs: :2 2-4% ahead).
    in_place_rs = kind == "matmul_rs" and world == 2 and dtype in ("bfloat16", "float16")
    one_piece = IN_PLACE_RS_S if in_place_rs else SHORT_REDUCE_S[kind]
    if gemm_s < one_piece:
        return Schedule("ce_push", 1), why + f": GEMM under {one_piece * 1e3:.1f} ms, one piece"
    if in_place_rs:
        # Two ranks, long GEMM: the peer pulls each partial with its own copy engine straight
        # into its output, and its GEMM adds in place (no staging, no local copy).  It leads
        # ce_push:2 by 0-4% at rs 8192^3, 16384x8192^2 and 16384x8192x7168 on H100 (11 of 12
        # comparisons, eager and replayed; on H200 expect a tie within ~2%), and it needs no
        # staging tensor (ce_push's is the whole unreduced product, 256 MiB at rs
        # 16384x8192^2).  (Float8 has no ce_pull.)
        return Schedule("ce_pull", 2), why + ": long GEMM, the peer pulls each partial into its output"
    if kind == "matmul_ar" and world == 2 and dtype in ("bfloat16", "float16"):
        # The same reduce-scatter, then the reduced pieces pushed and copied into place on the
        # local copy stream, so the pull of piece c + 1 does not queue behind the push of reduced
        # piece c (on one stream it runs ~20% behind ce_push:2).  So placed, ce_pull:2 ties
        # ce_push:2 eager and leads it by ~2-3% replayed at ar 8192^3, with no staging tensor
        # (ce_push's is the unreduced product, 128 MiB at ar 8192^3).
        return Schedule("ce_pull", 2), why + ": long GEMM, the peer pulls each partial into its output"
    return Schedule("ce_push", 2), why


def _float8_pick(kind: str, gemm_s: float, comm_s: float, graphs: bool) -> tuple[str, str] | None:
    """Where float8 regions (torch._scaled_mm, kernels/scaled.py) at two ranks part from the
    bf16 rule, else None.  Float8 e4m3 operands, bf16 products, K = 8192
    (docs/gpu-schedules.md, "The built-in rule"):
    - all-gathers run the peer's GEMM on a second stream (par=1): a float8 GEMM is half as
      long, and the peer's shard, landing during the own one, no longer waits for it
      (replayed 2-6% ahead of ce_push:1 from M_global 2048 to 16384x8192x28672; eager ahead or
      tied).
    - replayed reductions whose float8 GEMM is under MIN_GEMM_S_GRAPHS but at least half of it
      (the bf16 product moves as many bytes as a bf16 region's, whose GEMM would be twice as
      long and over the threshold): at M_global 2048 ce_push:1 runs 13-22% ahead of NCCL; at
      512 NCCL wins.
    - replayed all-reduces from there up run two pieces: the bf16 product's all-gather half is as
      long as a bf16 region's against half the GEMM, and the second piece hides the first's
      (M_global 2048 and 8192: ce_push:2 5-8% ahead of :1).  Eager, 8192^3 is in the band and
      timed at the first call, since the cards order :1 and :2 differently there."""
    if comm_s < (MIN_HIDDEN_COMM_S_GRAPHS if graphs else MIN_HIDDEN_COMM_S):
        return None
    if kind == "ag_matmul" and (graphs or gemm_s >= MIN_GEMM_S):
        return "ce_push:1:par=1", "float8 all-gather, the peer's GEMM beside the own shard's"
    if kind == "matmul_ar" and graphs and gemm_s >= MIN_GEMM_S_GRAPHS / 2:
        return "ce_push:2", "replayed float8 all-reduce, two pieces"
    if kind == "matmul_rs" and graphs and MIN_GEMM_S_GRAPHS / 2 <= gemm_s < MIN_GEMM_S_GRAPHS:
        return "ce_push:1", "short float8 reduction, its bf16 product worth hiding"
    return None
