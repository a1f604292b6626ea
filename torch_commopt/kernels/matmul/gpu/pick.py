"""The built-in schedule rule for CUDA regions (used until the tuner issue replaces it).

Pure arithmetic on shapes: importable without CUDA, so the compile-time pass can call it.
It estimates the GEMM time and the transfer time of a region with round ceilings of
2x H200 (NVLink copy ~300 GB/s one way; bf16 GEMM ~700 TFLOP/s achieved) and picks
(measured at 2 ranks; at 4 ranks, 4x H100, its picks beat or tied NCCL + cuBLAS on every
benchmark shape once the reductions summed their partials in one pass, session 27, but for
the replayed short all-gathers, which pick() treats apart, as it does long all-gathers there):
- `sequential` (NCCL + cuBLAS) when the shape is not one the GPU schedules take, or
  when the transfer is too small to be worth hiding (fixed costs -- a barrier, flag
  round trips, a second GEMM launch -- would exceed what overlap can save);
- otherwise the GPU schedule that measured fastest on the benchmark shapes
  (benchmarks/results/matmul_collectives_h200x2_*.md), by GEMM length.
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
# Below this estimated GEMM time an eager call is host-bound and NCCL + cuBLAS wins.  Until
# 2026-11-24 a GPU schedule cost 0.17-0.45 ms of host per call (torch Events, stream contexts
# and Tensor.copy_ on the side streams); with the side-stream work queued by driver calls
# (kernels/gpu/driver.py) a training step's ag_matmul calls went from 0.95 to 0.49 ms each
# under cProfile (bench_e2e --host-profile, 2x H200).  At M_global 512 (est. 0.05 ms) NCCL +
# cuBLAS still win eager on every host (ce_push:1 0.19-0.22 vs 0.08-0.09 ms, s13).
MIN_GEMM_S = 0.1e-3
# Replayed reductions: below this GEMM time NCCL's latency-optimal small collectives win.
MIN_GEMM_S_GRAPHS = 0.1e-3
# Replayed all-gathers and reduce-scatters at W > 2 below MIN_GEMM_S_GRAPHS: under this,
# NCCL + cuBLAS; above, ce_push:1 (for all-gathers gemm=whole, the W = 2 choice, lost to NCCL
# at 4 ranks; see pick()).
SHORT_GRAPHS_WIDE_S = 0.05e-3
# Eager calls between MIN_GEMM_S and SHORT_GEMM_S of estimated GEMM: whether ce_push:1 or
# NCCL + cuBLAS wins depends on the host's speed, which varies 2x between leases of one
# kind, so the rule names both to time at the region's first call (tuner.autotune) instead
# of guessing.  M_global 2048 (est. 0.2 ms), 2x H200: on a fast host ce_push:1 ran AG 0.199
# / RS 0.218 ms against NCCL's 0.287 / 0.278 (s7c); on a slow one (s13, torch async-TP's
# eager AG 0.525 ms there against 0.222 in s7c) AG 0.280 / RS 0.439 against 0.274 / 0.282.
# A first-call measurement can still mislead: with the old host path one chose ce_push:1 for
# AG 2048 that then ran 0.358 ms back to back against NCCL's 0.268 (s7b); with the new one
# (s13b) it chose ce_push:1 for AG / RS / AR 2048, which then ran 1.20x / 1.01x / 1.12x the
# best baseline.  The 5% margin in favour of NCCL (tuner.autotune.BAND_MARGIN) stays.
# Reduce-scatters also time direct:1 (the partial stored straight into the peer's output, no
# staging copy): eager RS M_global 2048, direct:1 / ce_push:1 / NCCL ms: 2x H100 s21 0.265 /
# 0.271 / 0.287 (the band measured only the last two and kept NCCL by the margin), s20 0.381 /
# 0.433 / 0.281; 2x H200 s7c 0.253 / 0.218 / 0.283, s13 0.392 / 0.439 / 0.282, s13b 0.270 /
# 0.264 / 0.280 -- direct:1 ahead of ce_push:1 in 3 of 5 runs.
BAND_CANDIDATES = {"ag_matmul": ["sequential", "ce_push:1"], "matmul_rs": ["sequential", "ce_push:1", "direct:1"],
                   "matmul_ar": ["sequential", "ce_push:1"]}
# Replayed two-rank bf16 / fp16 all-gathers under MIN_GEMM_S_GRAPHS: the two kinds of card
# order the GPU schedules differently, so the first call times them as graph replays.  M_global
# 512, K = N = 8192 (est. 49 us), ms: 2x H200 ce_push:1:par=1 0.075-0.077 against gemm=whole's
# 0.080-0.081 in all six sweeps that timed both (s23-s41), 2x H100 0.085-0.088 against
# 0.081-0.083 in all eight (s20-s38: two GEMMs, each reading the whole 64 MiB weight, side by
# side); torch async-TP 0.080 on H200, NCCL + cuBLAS 0.086.
REPLAYED_BAND_CANDIDATES = {"ag_matmul": ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]}
# The band's upper end: above it a GPU schedule's GEMM outlasts its host cost on every host
# seen (RS 8192^3, est. 0.79 ms: ce_push:1 1.10x the best baseline eager on s13's slow host,
# 1.15x on s13b's).
SHORT_GEMM_S = 0.5e-3
# All-gathers at two ranks whose GEMM is estimated in [SHORT_GEMM_S, PAR_MAX_GEMM_S) run the
# peer's GEMM on a second compute stream beside the own shard's (ce_push:1:par=1): it fills
# the own GEMM's last wave instead of queueing behind it.  Same-run comparisons, ce_push:1 ->
# par=1 (ms, eager / replayed): 2x H200 s25b 8192^3 0.802 -> 0.779 / 0.808 -> 0.776,
# 16384x8192^2 1.635 -> 1.565 / 1.626 -> 1.575, 4096x8192x28672 1.419 -> 1.385 / 1.433 ->
# 1.414; 2x H200 s36 (matmul_collectives_h200x2_2026-11-27_cg) 0.800 -> 0.798 / 0.795 ->
# 0.790, 1.627 -> 1.586 / 1.616 -> 1.581, 1.458 -> 1.442 / 1.457 -> 1.424; 2x H100 s35 and
# s36 1-5% the same way.  At 16384x8192x28672 (est. 5.5 ms) it lost 1.0-1.4% on both H200
# runs (5.718 -> 5.776, 5.766 -> 5.850 eager): above PAR_MAX_GEMM_S the two GEMMs only share
# the SMs.  (Not re-benchmarked after the rule changed.)
PAR_MAX_GEMM_S = 3e-3
# Replayed, par=1 pays from here (no host cost to stand against the second stream's event):
# M_global 2048 (K = N = 8192, est. 0.19 ms) ran ce_push:1:par=1 faster than ce_push:1 in all 15
# sweeps that timed both (10 on 2x H100, s20-s38: 0.2034-0.2100 vs 0.2090-0.2186 ms; 5 on 2x H200,
# s23-s40: 0.2027-0.2071 vs 0.2076-0.2131).  Below it (M_global 512, est. 49 us) the cards part:
# H200 par=1 0.075-0.077 vs gemm=whole 0.080-0.081, H100 0.085-0.088 vs 0.081-0.083 (two GEMMs
# each reading the whole weight beside each other): gemm=whole is the rule's pick there, and at
# two ranks the first call times both (REPLAYED_BAND_CANDIDATES).
PAR_MIN_GEMM_S_GRAPHS = 0.1e-3
# Reductions run ce_push:1 below this estimated GEMM time, ce_push:2 above (see pick()).
SHORT_REDUCE_S = {"matmul_rs": 1.0e-3, "matmul_ar": 0.5e-3}
# Two-rank bf16 / fp16 reduce-scatters, whose received partial is added in place, run two pieces
# from here (ce_pull:2, see pick()).  Float8 ones sum their partials in one pass after the GEMM and
# wider groups sum W slots (untouched by the copy-ordering fix that moved these): they keep
# SHORT_REDUCE_S (4x H100 s34, rs 16384x8192x7168 at W = 4, est. 0.69 ms: ce_push:1 0.942 / 0.909
# ms eager / replayed vs :2 1.009 / 1.004; float8 16384x8192x7168 at W = 2, 2x H200 replayed
# 0.938 / 0.937 vs 0.969 / 0.967, matmul_collectives_h200x2_2026-11-27_float8{,_b}).
IN_PLACE_RS_S = 0.5e-3


def call_graphs_pay(kind: str, a_shape: list[int], weight_shapes: list[list[int]], world: int, dtype: str,
                    longer: bool = False) -> bool:
    """Whether an eager region's calls should replay per-call CUDA graphs (Config.call_graphs):
    its GEMM is estimated in [MIN_GEMM_S, SHORT_GEMM_S), the band where an eager call's host
    cost decides between a GPU schedule and NCCL.  2x H100, K = N = 8192, eager back to back
    (matmul_collectives_h100x2_2026-11-27_s35_cg, ms): M_global 2048 AG ce_push:1 with cg=1
    0.199 vs NCCL 0.276, RS 0.207 vs 0.283, AR 0.289 vs 0.327 (without: 0.253, 0.297, 0.351 in
    s34).  Below MIN_GEMM_S the replayed call still pays ~0.1 ms of host (the op's dispatch,
    its key, the graph launch) against ~0.08 of GPU: M_global 512 AG gemm=whole with cg=1
    0.095 vs NCCL 0.092, so NCCL + cuBLAS stay.  Longer regions hide their host cost behind
    the GEMM, and a graph would only hold memory for their (large) staging tensors (RS 8192^3
    ce_push:1 replayed 0.891-0.914 ms vs eager 0.885-0.901, probe_call_graph.py).
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
        # may pay eager too (M_global 8192, ce_push:2 vs :1: 2x H200 0.732 / 0.736 vs 0.773 /
        # 0.779 ms; 2x H100 0.927 vs 0.819), so the first call times them both
        return BAND_CANDIDATES[kind] + ["ce_push:2"]
    return list(BAND_CANDIDATES[kind])


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
                # in (M_global 512, K = N = 8192: 2x H100 gemm=whole 0.082 ms vs ce_push:1 0.091,
                # NCCL 0.088, matmul_collectives_h100x2_2026-11-25_s20; 2x H200 0.082 / 0.082 /
                # 0.084, s13b).
                return Schedule.parse("ce_push:1:gemm=whole"), why + ": short GEMM, one GEMM after the gather"
            # Over more than one peer the whole GEMM waits for the last of W - 1 shards.  4x
            # H100 (matmul_collectives_h100x4_2026-11-26), K = N = 8192: M_global 512 (est. 25
            # us) NCCL 0.082 ms, gemm=whole 0.098, ce_push:1 0.108; M_global 2048 (est. 98 us)
            # NCCL 0.197, gemm=whole 0.225, ce_push:1 0.182.
            if gemm_s < SHORT_GRAPHS_WIDE_S:
                return Schedule("sequential"), why + f": short GEMM over {world - 1} peers' shards, NCCL + cuBLAS"
            return Schedule("ce_push", 1), why + f": short GEMM over {world - 1} peers' shards, one piece each"
        if world > 2 and gemm_s >= SHORT_GEMM_S and dtype in ("bfloat16", "float16"):
            # More than one peer: cuBLAS runs W GEMMs of M/W rows each, the fused persistent
            # kernel one pass over every tile as its rows land.  4x H100 (ms, eager / replayed,
            # matmul_collectives_h100x4_2026-11-26): 4096x8192x28672 fused:2:tma=1 0.738 / 0.716
            # vs ce_push:1 0.806 / 0.850 (async-TP 0.858 / 0.811); 16384x8192x14336 1.468 / 1.449
            # vs 1.579 / 1.608; 16384x8192x8192 0.838 / 0.829 vs 0.844 / 0.846; 16384x8192x28672
            # 2.918 / 2.927 vs 2.897 / 2.968.  Under SHORT_GEMM_S it was mixed (8192^3: 0.468 /
            # 0.428 vs 0.443 / 0.444) and ce_push:1 stays.
            return Schedule.parse("fused:2:tma=1"), why + f": {world - 1} peers, one fused pass over the tiles"
        if world <= 2 and (PAR_MIN_GEMM_S_GRAPHS if graphs else SHORT_GEMM_S) <= gemm_s < PAR_MAX_GEMM_S:
            return Schedule.parse("ce_push:1:par=1"), why + ": the peer's GEMM beside the own shard's (par=1)"
        # One piece: the peer's shard lands long before the own shard's GEMM ends, and more
        # pieces only add GEMM tails (16384x8192x28672: ce_push:1 5.820 / 5.771 ms vs :4
        # 5.838 / 5.834 in two runs).
        return Schedule("ce_push", 1), why
    if graphs and gemm_s < MIN_GEMM_S_GRAPHS:
        if kind == "matmul_rs" and world > 2 and gemm_s >= SHORT_GRAPHS_WIDE_S:
            # Over more than one peer NCCL's reduce-scatter moves W - 1 pieces after the whole
            # GEMM; ce_push:1 ships each peer's piece as soon as its GEMM ends.  4x H100,
            # replayed (matmul_collectives_h100x4_2026-11-27_s34_world4), K = N = 8192:
            # M_global 2048 (est. 98 us) ce_push:1 0.202 ms vs NCCL 0.227 (async-TP 0.207);
            # M_global 512 (est. 25 us) NCCL 0.070 vs ce_push:1 0.110.  The all-reduce keeps
            # NCCL (M_global 2048: 0.292 vs ce_push:1 0.321).
            return Schedule("ce_push", 1), why + f": short GEMM, {world - 1} peers' pieces shipped as they end"
        # Replayed (2x H200, CUDA graphs): at M_global 512 NCCL + cuBLAS beat every
        # reduction schedule (0.080 vs direct:1 0.086 ms).
        return Schedule("sequential"), why + ": short reduction, GPU-side fixed costs exceed the overlap"
    if not graphs and gemm_s < SHORT_GEMM_S and kind == "matmul_ar":
        # (inside the band: the fallback when the first-call measurement cannot run)
        return Schedule("sequential"), why + ": short GEMM, all-reduce ties NCCL eager"
    # One piece while the GEMM is short: the own GEMM runs first and the peer's partial is
    # added after it, and a second piece only adds a GEMM tail (2x H200, s7, replayed / eager:
    # rs 2048 ce_push:1 0.223 vs :2 0.241 ms; rs 4096x8192x7168 0.399 / 0.409 vs 0.421 / 0.462;
    # ar 2048 0.280 vs 0.288).  Longer GEMMs hide the last transfer better in two pieces (rs
    # 16384x8192^2 :2 1.695 / 1.727 vs :1 1.749 / 1.794; ar 8192^3 0.972 / 1.012 vs 1.015 /
    # 1.036).  rs 8192^3 ran :1 until the copy of the first received partial stopped waiting
    # for this rank's own peer GEMMs (session 37): then 2x H100, eager / replayed, :2 0.855 /
    # 0.870 ms vs :1 0.885 / 0.884 (before, in the same session: 0.889 / 0.897 vs 0.889 / 0.877).
    in_place_rs = kind == "matmul_rs" and world == 2 and dtype in ("bfloat16", "float16")
    one_piece = IN_PLACE_RS_S if in_place_rs else SHORT_REDUCE_S[kind]
    if gemm_s < one_piece:
        return Schedule("ce_push", 1), why + f": GEMM under {one_piece * 1e3:.1f} ms, one piece"
    if in_place_rs:
        # Two ranks, long GEMM: the peer pulls each partial with its own copy engine straight
        # into its output, and its GEMM adds in place (no staging, no local copy).  ce_pull:2
        # gained most from the copy-ordering fix (rs 8192^3 0.939 -> 0.852 ms eager) and then
        # led ce_push:2 in 11 of 12 same-run comparisons on 2x H100 (two sweeps, eager and
        # replayed, rs 8192^3, 16384x8192^2, 16384x8192x7168; session 37): 0.852 / 0.845 vs
        # 0.855 / 0.842, 1.687 / 1.664 vs 1.707 / 1.737, 1.499 / 1.442 vs 1.515 / 1.537 eager;
        # 0.853 / 0.865 vs 0.870 / 0.869, 1.676 / 1.677 vs 1.696 / 1.723, 1.480 / 1.468 vs
        # 1.496 / 1.496 replayed.  It also needs no staging tensor (ce_push's is the whole
        # unreduced product, 256 MiB at rs 16384x8192^2).  On H200 it is not measured since the
        # fix: before it, ce_pull:2 / ce_push:2 ran 1.03-1.16 there against 1.03-1.12 on H100, so
        # expect a tie within ~2% there.  (Float8 has no ce_pull.)
        return Schedule("ce_pull", 2), why + ": long GEMM, the peer pulls each partial into its output"
    if kind == "matmul_ar" and world == 2 and dtype in ("bfloat16", "float16"):
        # The same reduce-scatter, then the reduced pieces pushed and copied into place on the
        # local copy stream.  Until session 38 a matmul_ar's pull of piece c + 1 queued behind its
        # push of reduced piece c on one stream (ar 8192^3 ce_pull:2 1.216 vs ce_push:2 1.004 ms).
        # With the pulls and the gathered copies on the local copy stream, 2x H100 s38, same-call
        # A/B, two rounds, eager / replayed (matmul_collectives_h100x2_2026-11-27_s38_ab*):
        # ce_pull:2 0.960 / 0.930 and 0.961 / 0.930 vs ce_push:2 0.957 / 0.960 and 0.974 / 0.951;
        # no staging tensor (ce_push's is the unreduced product, 128 MiB at ar 8192^3).
        return Schedule("ce_pull", 2), why + ": long GEMM, the peer pulls each partial into its output"
    return Schedule("ce_push", 2), why


def _float8_pick(kind: str, gemm_s: float, comm_s: float, graphs: bool) -> tuple[str, str] | None:
    """Where float8 regions (torch._scaled_mm, kernels/scaled.py) at two ranks part from the
    bf16 rule, else None.  2x H100, float8 e4m3 operands, bf16 products, K = 8192
    (matmul_collectives_h100x2_2026-11-27_float8, ms):
    - all-gathers run the peer's GEMM on a second stream (par=1): a float8 GEMM is half as
      long, and the peer's shard, landing during the own one, no longer waits for it.
      Replayed: 8192^3 0.415 vs ce_push:1 0.440 (torch async-TP 0.435), 16384x8192^2 0.823 vs
      0.867, 4096x8192x28672 0.744 vs 0.765 (async-TP 0.747), 16384x8192x28672 2.957 vs 3.007,
      M_global 2048 0.117 vs 0.122 (gemm=whole 0.142, async-TP 0.123), 512 0.055 (a tie with
      gemm=whole); eager 0.819 vs 0.854, 0.738 vs 0.758, and ties at 8192^3 and
      16384x8192x28672.
    - replayed reductions whose float8 GEMM is under MIN_GEMM_S_GRAPHS but at least half of it
      (the bf16 product moves as many bytes as a bf16 region's, whose GEMM would be twice as
      long and over the threshold): M_global 2048 RS ce_push:1 0.169 vs NCCL 0.216 (async-TP
      0.169), AR 0.226 vs 0.260; at 512 NCCL wins (RS 0.063 vs 0.082).
    - replayed all-reduces from there up run two pieces: the bf16 product's all-gather half is as
      long as a bf16 region's against half the GEMM, and the second piece hides the first's.
      M_global 8192 / 2048, ce_push:2 vs :1: 2x H100 0.729 vs 0.786 / 0.215 vs 0.226; 2x H200
      (matmul_collectives_h200x2_2026-11-27_float8{,_b}) 0.700 vs 0.752, 0.690 vs 0.748 / 0.212
      vs 0.223, 0.208 vs 0.221.  (Eager 8192^3 is in the band, timed at the first call: there
      H100 measured :1 ahead, 0.819 vs 0.927, H200 :2, 0.732 vs 0.773.)"""
    if comm_s < (MIN_HIDDEN_COMM_S_GRAPHS if graphs else MIN_HIDDEN_COMM_S):
        return None
    if kind == "ag_matmul" and (graphs or gemm_s >= MIN_GEMM_S):
        return "ce_push:1:par=1", "float8 all-gather, the peer's GEMM beside the own shard's"
    if kind == "matmul_ar" and graphs and gemm_s >= MIN_GEMM_S_GRAPHS / 2:
        return "ce_push:2", "replayed float8 all-reduce, two pieces"
    if kind == "matmul_rs" and graphs and MIN_GEMM_S_GRAPHS / 2 <= gemm_s < MIN_GEMM_S_GRAPHS:
        return "ce_push:1", "short float8 reduction, its bf16 product worth hiding"
    return None
