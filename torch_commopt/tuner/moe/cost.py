"""Cost estimates of the expert-parallel schedules: alpha-beta links + GEMM fits (calibration.py).

Pure arithmetic (no device, no process group).  Per pass (forward: the three products of the
SwiGLU; backward: twice that, data and weight gradients), for R rows a rank routes (the call's
peak), D model dim, H expert hidden dim, W ranks, b bytes an element, on balanced routing:

    exchange of one direction:  V = R * D * b * (W - 1) / W bytes  (every rank sends and receives)
    a2a          2 link(V) + G                            both exchanges exposed
    by_expert:C  link(f_0 V) + link(f_last V) + max(G', B) + s * min(G', B) + o_C * G',  G' = k(H) G,
                 B = sum over c > 0 of link(f_c V) + sum over c < last of link(f_c V)

f_c is chunk c's share of the experts (by_expert.chunk_bounds: from three chunks on, the first and
last are half the others).  The first chunk's dispatch and the last chunk's combine are exposed;
the others run beside the experts' GEMMs, which they slow by s times the shorter of the two (the
calibration's overlap_slowdown for the copy engine, collective_overlap_slowdown for NCCL's
kernels, which take SMs).  by_expert's compute is its own SwiGLU with its reorders (kernels/moe/by_expert.py), which costs
k(H) = 1 + BASE_OVERHEAD / H times torchtitan's grouped GEMMs that a2a runs (H the expert hidden
size; one H200, by_expert:1 / whole: 1.30-1.36 at H 1408, 1.58-1.70 at H 768, 1.06-1.07 at H 14336
in benchmarks/results/moe_pieces_h200x1_*; on 2x H200, by_expert 0.79-0.99x of a2a at every case of
benchmarks/results/moe_h200x2_*).  o_C is what cutting the experts into C chunks costs their compute,
measured on one H200 at 8K-16K tokens a rank on the fine-grained shapes
(benchmarks/results/moe_pieces_h200x1_*: by_expert:2 0.98-1.05x of by_expert:1, by_expert:4
1.01-1.24x, by_expert:6 1.06-1.69x).  by_peer is never proposed: its pieces by source cost the
compute 9-77% there (the same report).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_commopt.kernels.moe.by_expert import chunk_bounds
from torch_commopt.tuner.calibration import Calibration

CHUNK_OVERHEAD = {2: 0.01, 4: 0.10, 6: 0.25}  # o_C (module docstring)
BASE_OVERHEAD = 500.0  # k(H) = 1 + BASE_OVERHEAD / H: by_expert's compute over a2a's (module docstring)


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
    if shape.transport == "ce" and cal.p2p is not None:
        link, slowdown = cal.p2p, cal.overlap_slowdown
    else:
        link = cal.collective["all_gather"]
        slowdown = cal.overlap_slowdown if cal.collective_overlap_slowdown is None else cal.collective_overlap_slowdown
    volume = r * d * shape.elt * (shape.world - 1) / shape.world
    out = {"a2a": sum(2 * link.time(volume) + g for g in (forward, 2 * forward))}
    own = 1 + BASE_OVERHEAD / h  # by_expert's SwiGLU and reorders against the grouped GEMMs
    for chunks, overhead in CHUNK_OVERHEAD.items():
        if chunks > shape.local_experts:
            continue
        pieces = [link.time(volume * (hi - lo) / shape.local_experts)
                  for lo, hi in chunk_bounds(shape.local_experts, chunks)]
        exposed = pieces[0] + pieces[-1]
        beside = sum(pieces[1:]) + sum(pieces[:-1])
        out[f"by_expert:{chunks}"] = sum(exposed + max(g, beside) + slowdown * min(g, beside) + overhead * g
                                         for g in (own * forward, 2 * own * forward))
    return out


def best(shape: MoEShape, cal: Calibration) -> tuple[str, dict[str, float]]:
    """The cheapest schedule (a2a on a tie: it is always a candidate) and every estimate."""
    est = estimates(shape, cal)
    return min(est, key=lambda k: (est[k], k != "a2a")), est
