"""Model-driven schedule choice for one region (Config.mode = "model").

Pure in its inputs (shapes, dtype, device, group) so the compile pass can call it with
a region's static facts.  The machine's calibration comes from the tuner cache through
a rank-0 decision (every rank ranks with the same numbers, so every rank picks the same
schedule), or, where this machine has not been measured, from the reference priors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.gpu.pick import gpu_refusal
from torch_commopt.tuner.calibration import Calibration
from torch_commopt.tuner.machine import stored_calibration
from torch_commopt.tuner.matmul.model import Prediction, RegionFacts, RegionShape, candidates, rank

log = logging.getLogger("torch_commopt.tuner.matmul.choose")

def choose_by_model(facts: RegionFacts, cal: Calibration, max_chunks: int, *,
                    graphs: bool | str = False,
                    gemms: Callable[[RegionShape, list[Schedule], bool | str], Calibration] | None = None,
                    ) -> tuple[Schedule, list[Prediction], str]:
    """(schedule, ranked predictions, why) for a region; candidates cut more than
    `max_chunks` pieces are left out, GPU ones too where the kernels refuse the shape.
    graphs=True: ranked for CUDA-graph replay (no per-call host cost); PER_CALL: for per-call
    graphs (the same, with their measured slowdown).  facts.copy_bytes: what the
    graph copies only for an op of ours, kept_bytes: what the region kept as compiled moves
    beyond one matmul, k_parts: the K of each product the op multiplies apart (RegionShape).
    gemms: given the shape, the candidates and `graphs`, `cal` with the GEMMs their ranking prices
    timed (tuner.gemm_table.with_gemms); None: the fit prices them."""
    shape, kind, k_parts = facts.shape, facts.kind, facts.k_parts
    copy_bytes, kept_bytes = facts.copy_bytes, facts.kept_bytes
    refusal = gpu_refusal(kind, list(facts.a_shape), [list(w) for w in facts.weight_shapes], facts.dim, facts.world)
    pool = [s for s in candidates(shape, cal, graphs=graphs)
            if s.chunks <= max(1, max_chunks) and not (s.is_gpu and refusal)]
    if gemms is not None:
        cal = gemms(shape, pool, graphs)
    preds = rank(shape, cal, pool, graphs=graphs)
    best = preds[0]
    why = f"predicted {best.seconds * 1e3:.3f} ms with the {cal.source} calibration of {cal.device}"
    if graphs and cal.device != "cpu":
        why += ", replayed from CUDA graphs (no host cost)" if graphs is True else ", replayed from per-call CUDA graphs"
    if refusal and cal.p2p is not None:
        why += f"; GPU schedules left out: {refusal}"
    if k_parts:
        why += f"; K parts {'+'.join(map(str, k_parts))} multiplied apart"
    if copy_bytes and cal.local_copy is not None:  # the charge (model._graph_copies) needs that figure
        payer = "fused (K parts concatenated)" if k_parts else "every candidate but sequential (kept as compiled)"
        why += (f"; {payer} pays concat-K's {copy_bytes / 2**20:.1f} MiB of copies, sequential the sum's "
                f"{kept_bytes / 2**20:.1f} MiB")
    return best.schedule, preds, why


def explain_shapes(specs: list[str], world: int, device: str, dtype: str | None, cache_dir: str | None) -> str:
    """The model's ranking for shapes given as "KIND:ROWSxKxN[,N2...]" (what the CLI prints)."""
    cal = stored_calibration(device, world, cache_dir)
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    lines = [f"cost model: {cal.source} calibration of {cal.device} x{world}, {dtype}"]
    for spec in specs:
        kind, _, dims = spec.partition(":")
        try:
            rows, k, ns = dims.split("x")
            shape = RegionShape(kind, int(rows), int(k), tuple(int(n) for n in ns.split(",")), world, dtype)
        except ValueError as e:
            raise ValueError(f"commopt explain: bad --shape {spec!r} (want KIND:ROWSxKxN[,N2...]): {e}") from e
        preds = rank(shape, cal)
        lines.append(f"{spec}:")
        lines += [f"  {str(p.schedule):<12} {p.seconds * 1e3:9.3f} ms  (gpu {p.gpu_s * 1e3:.3f}, host {p.host_s * 1e3:.3f}, "
                  f"+{p.extra_bytes / 2**20:.0f} MiB)" for p in preds]
    return "\n".join(lines)
