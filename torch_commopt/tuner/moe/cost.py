"""Cost estimates of the expert-parallel schedules: alpha-beta links + GEMM fits (calibration.py).

Pure arithmetic (no device, no process group).  Per pass (forward: the three products of the
SwiGLU; backward: twice that, data and weight gradients), for R rows a rank routes (the call's
peak), D model dim, H expert hidden dim, W ranks, b bytes an element, on balanced routing:

    exchange of one direction:  V = R * D * b * (W - 1) / W bytes  (every rank sends and receives)
    rows moved on the device:   M = R * D * b bytes, priced by the calibration's local copy
    a2a          2 link_nccl(V) + G + 2 copy(M)   (NCCL's all-to-all, whatever by_expert's transport)
    by_expert:C  link(f_0 V) + link(f_last V) + max(G', B) + s * min(G', B) + 3 copy(M),
                 G' = (1 + o_C + KNEE_ROWS / r_min) G,
                 B = sum over c > 0 of link(f_c V) + sum over c < last of link(f_c V)

f_c is chunk c's share of the experts (by_expert.chunk_bounds: from three chunks on, the first and
last are half the others).  The first chunk's dispatch and the last chunk's combine are exposed;
the others run beside the experts' GEMMs, which they slow by s times the shorter of the two (the
calibration's overlap_slowdown for the copy engine, collective_overlap_slowdown for NCCL's
kernels, which take SMs).

The copies are what each schedule moves on the device besides its exchange: a2a places the
received rows into their experts' padded groups and gathers the outputs back (2 M a pass);
by_expert does the same from its landing slots and copies the outputs that come home out of
theirs (3 M).  o_C is what cutting the experts into C chunks costs: 1% for two chunks (one H200,
benchmarks/results/moe_pieces_h200x1_*: by_expert:2 1.01-1.05x of by_expert:1 at 8K-16K tokens a
rank, median 1.02, a few percent apart from run to run; on 2x H200 two chunks ran the Mixtral-like
layer at 16K tokens a rank 1.5% ahead of a2a, which 2% would not pick); for four and six, set from
2x H200, where by_expert:4 ran 1-23% slower than
by_expert:2 on the fine-grained layers at 4K-16K tokens a rank (the one-GPU pieces, which move
nothing between GPUs, had it 2-18%).  KNEE_ROWS / r_min (r_min the smallest chunk's
rows) is what a chunk's grouped GEMMs lose when they get few rows: on 2x H200 the Mixtral-like
layer at 4K tokens a rank (2 chunks of 4096 rows) ran its chunked GEMMs 6.8% slower than a2a's
whole ones, and by_expert 3.4% slower than a2a, while at 8K and 16K it won by 2.0% and 1.5%; the
DeepSeek-V2-Lite- and Qwen3-30B-A3B-like layers (12K+ rows a chunk) won by 3.5-9%
(benchmarks/results/moe_h200x2_*).  150 rows gets the sign of all seven measured differences
right.

by_expert does more on the host than a2a (its plan, a run copy or two a chunk, the flag
operations of each transfer): on 2x H200, 1.4-1.5 ms more per forward and backward at 4K tokens a
rank, where the layer's GPU work is short enough that the host sets the pace.  There by_expert ran
0.99x torchtitan's EP while a2a ran 1.16-1.17x (the DeepSeek-V2-Lite- and Qwen3-30B-A3B-like
layers, a2a estimated at 3.8 and 2.8 ms); from 8K tokens (a2a estimated at 5.5 ms and more) by_expert
won.  So by_expert is proposed only for calls whose a2a estimate is at least MIN_PIPELINED_S.
by_peer is never proposed: its pieces by source cost the compute 10-47% there (the
pieces report).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_commopt.kernels.moe.by_expert import chunk_bounds
from torch_commopt.tuner.calibration import Calibration

CHUNK_OVERHEAD = {2: 0.01, 4: 0.20, 6: 0.35}  # o_C (module docstring)
KNEE_ROWS = 150.0  # a chunk's GEMMs lose KNEE_ROWS / its rows (module docstring)
MIN_PIPELINED_S = 4.5e-3  # below this much a2a work a call, by_expert's host work is exposed (module docstring)
COPIES = {"a2a": 2, "by_expert": 3}
# A compiled graph's launch of one op, what each op of a chunked region costs again per extra
# chunk (capacity_estimates).  An assumption of the order of Inductor's launches on the H200
# hosts (a few microseconds each), not a measurement of the chunked regions.
LAUNCH_S = 5e-6  # passes over the routed rows on the device besides the exchange


@dataclass(frozen=True)
class MoEShape:
    rows: int  # rows a rank routes (the peak over ranks)
    dim: int
    hidden: int
    local_experts: int
    world: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    transport: str  # "ce" or "nccl"

    @property
    def elt(self) -> int:
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)


def estimates(shape: MoEShape, cal: Calibration) -> dict[str, float]:
    """Seconds of a forward and backward pass of each candidate schedule (module docstring)."""
    fit = cal.gemm.get(shape.dtype) or cal.gemm.get("float32") or next(iter(cal.gemm.values()))
    r, d, h = shape.rows, shape.dim, shape.hidden
    forward = 2 * fit.time(r, h, d) + fit.time(r, d, h)
    link, slowdown = _link(shape, cal)
    volume = r * d * shape.elt * (shape.world - 1) / shape.world
    # one pass over the routed rows on the device (a calibration without a local copy, a CPU's:
    # not priced, the same for every candidate's passes)
    moved = _copy(cal, r * d * shape.elt)
    nccl = cal.collective["all_gather"]  # a2a's exchange is NCCL's all-to-all whatever by_expert's transport
    out = {"a2a": sum(2 * nccl.time(volume) + g + COPIES["a2a"] * moved for g in (forward, 2 * forward))}
    for chunks in CHUNK_OVERHEAD:
        if chunks > shape.local_experts or out["a2a"] < MIN_PIPELINED_S:
            continue
        out[f"by_expert:{chunks}"] = sum(_pipelined(shape, (link, slowdown), volume, g, chunks)
                                         + COPIES["by_expert"] * moved for g in (forward, 2 * forward))
    return out


def _pipelined(shape: MoEShape, link_slowdown: tuple, volume: float, gemm_s: float, chunks: int) -> float:
    """The exchange of `volume` bytes in `chunks` chunks of experts beside `gemm_s` of GEMMs:
    the first chunk's dispatch and the last one's combine exposed, the rest beside the chunked
    GEMMs (module docstring: G', B and s)."""
    link, slowdown = link_slowdown
    bounds = chunk_bounds(shape.local_experts, chunks)
    pieces = [link.time(volume * (hi - lo) / shape.local_experts) for lo, hi in bounds]
    beside = sum(pieces[1:]) + sum(pieces[:-1])
    fewest = shape.rows * min(hi - lo for lo, hi in bounds) / shape.local_experts  # the smallest chunk's rows
    own = (1 + CHUNK_OVERHEAD[chunks] + KNEE_ROWS / max(fewest, 1.0)) * gemm_s
    return pieces[0] + pieces[-1] + max(own, beside) + slowdown * min(own, beside)


def _link(shape: MoEShape, cal: Calibration):
    """(the exchange's link, the slowdown it costs the GEMMs beside it) for shape's transport."""
    if shape.transport == "ce" and cal.p2p is not None:
        return cal.p2p, cal.overlap_slowdown
    slowdown = cal.overlap_slowdown if cal.collective_overlap_slowdown is None else cal.collective_overlap_slowdown
    return cal.collective["all_gather"], slowdown


def _copy(cal: Calibration, nbytes: float) -> float:
    return cal.local_copy.time(nbytes) if cal.local_copy is not None else 0.0


def capacity_estimates(shape: MoEShape, cal: Calibration, gemm_s: float, joined_bytes: float,
                       ops: int) -> dict[str, float]:
    """Seconds of one graph's fixed-capacity exchange pair (passes/moe/capacity.py): kept ("a2a"),
    or in C chunks of experts on the graph's own collectives (NCCL).  gemm_s: the region's
    batched GEMMs; joined_bytes: the region's tensors the rest of the graph reads, put back
    together from their chunks; ops: the region's ops, launched once a chunk.

        a2a          2 nccl(V) + G
        by_expert:C  nccl(f_0 V) + nccl(f_last V) + max(G', B) + s min(G', B)
                     + copy(2 R D b + joined) + (C - 1) (ops + 4) LAUNCH_S

    with G', B and s as in `estimates` (the cut of the send buffer and the join of what comes
    home are one pass each over the rows); no MIN_PIPELINED_S: the chunks are the compiled
    graph's own launches, with no plan on the host."""
    link, slowdown = _link(shape, cal)
    volume = shape.rows * shape.dim * shape.elt * (shape.world - 1) / shape.world
    out = {"a2a": 2 * link.time(volume) + gemm_s}
    copies = _copy(cal, 2 * shape.rows * shape.dim * shape.elt + joined_bytes)
    for chunks in CHUNK_OVERHEAD:
        if chunks <= shape.local_experts:
            out[f"by_expert:{chunks}"] = (_pipelined(shape, (link, slowdown), volume, gemm_s, chunks) + copies
                                          + (chunks - 1) * (ops + 4) * LAUNCH_S)
    return out


def best(shape: MoEShape, cal: Calibration) -> tuple[str, dict[str, float]]:
    """The cheapest schedule (a2a on a tie: it is always a candidate) and every estimate."""
    est = estimates(shape, cal)
    return min(est, key=lambda k: (est[k], k != "a2a")), est
