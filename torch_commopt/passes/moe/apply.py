"""The fixed-capacity MoE rewrite as the post-grad pass runs it: find, choose the chunks, agree
across ranks, rewrite (capacity.py).  Config.moe_schedule decides, as it does for optimize()'d
modules: "a2a" keeps the graph's exchanges, "by_expert:C" runs C chunks, "auto" takes the cost
model's pick (tuner/moe/cost.py, the exchange on NCCL: the graph's own collectives) with rank 0's
answer adopted by all; "by_peer" is not offered here (pieces by source shrink every expert's GEMM)."""

from __future__ import annotations

import logging
import math

from torch.fx import Graph

from torch_commopt.core.moe_spec import parse_moe_schedule
from torch_commopt.kernels.moe.by_expert import DEFAULT_CHUNKS, chunk_bounds
from torch_commopt.passes.graph_utils import BMM, static_shape, val
from torch_commopt.passes.moe.capacity import CapacityRegion, find, rewrite

log = logging.getLogger("torch_commopt.passes.moe")


def rewrite_capacity_moe(graph: Graph, schedule: str, timeout_s: float | None, cache_dir: str | None,
                         skipped: list) -> list[str]:
    """Rewrite the graph's fixed-capacity MoE regions under `schedule`; explain notes.
    `skipped` gets the candidates left untouched (report.skipped)."""
    regions, skips = find(graph)
    skipped += skips
    if not regions:
        return []
    name, chunks = parse_moe_schedule(schedule)
    picks = [_pick(r, name, chunks, timeout_s, cache_dir) for r in regions]
    disagree = _ranks_disagree(regions, picks, schedule, timeout_s)
    if disagree:
        return [disagree]
    notes = []
    for r, (c, why) in zip(regions, picks):
        if c <= 1:
            notes.append(f"moe {r.dispatch.name}: kept ({why}); {r.summary()}")
            continue
        bounds, head = chunk_bounds(r.local_experts, c), f"moe {r.dispatch.name}"
        summary = r.summary()
        rewrite(graph, r, bounds)
        notes.append(f"{head}: rewritten, by_expert:{len(bounds)} ({why}); {summary}")
    if any(c > 1 for c, _ in picks):
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.lint()
    log.info("commopt moe: %s", "; ".join(notes))
    return notes


def _pick(r: CapacityRegion, name: str, chunks: int | None, timeout_s: float | None,
          cache_dir: str | None) -> tuple[int, str]:
    """(chunks, why): 1 keeps the region as compiled."""
    if name == "a2a":
        return 1, "Config.moe_schedule a2a"
    if name in ("by_peer", "sync_free"):
        return 1, f"{name} runs on optimize()'d modules only"
    if name == "by_expert":
        return chunks or DEFAULT_CHUNKS, f"Config.moe_schedule {name}{f':{chunks}' if chunks else ''}"
    pick, est = _estimate(r, timeout_s, cache_dir)
    text = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in est.items())
    return (1 if pick == "a2a" else parse_moe_schedule(pick)[1] or DEFAULT_CHUNKS), f"auto: {pick} (model, ms: {text})"


def _estimate(r: CapacityRegion, timeout_s: float | None, cache_dir: str | None) -> tuple[str, dict]:
    """The cost model's pick for `r` (tuner/moe/cost.capacity_estimates), rank 0's for all."""
    from torch_commopt.tuner.decide import decide
    from torch_commopt.tuner.machine import calibration_for, device_name
    from torch_commopt.tuner.moe.cost import MoEShape, capacity_estimates

    x = val(r.dispatch.args[0])
    first = next(n for n in r.region if n.target is BMM)
    dtype = str(x.dtype).removeprefix("torch.")
    shape = MoEShape(rows=int(x.shape[0]), dim=math.prod(int(s) for s in x.shape[1:]),
                     hidden=int(static_shape(first)[-1]), local_experts=r.local_experts, world=r.world,
                     dtype=dtype, transport="nccl")
    joined = sum(val(n).numel() * val(n).element_size() for n in r.read_outside())
    timeout = timeout_s if timeout_s is not None else 300.0
    cal = calibration_for(x.device, r.world, r.group_name, cache_dir, timeout)

    def answer() -> list:
        fit = cal.gemm.get(dtype) or cal.gemm.get("float32") or next(iter(cal.gemm.values()))
        est = capacity_estimates(shape, cal, sum(fit.time(m, n, k) for m, n, k in r.gemms()), joined, len(r.region))
        return [min(est, key=lambda k: (est[k], k != "a2a")), est]

    question = {"question": "capacity moe schedule", "device": device_name(x.device), "joined": joined,
                "gemms": r.gemms(), "ops": len(r.region), **shape.__dict__}
    pick, est = decide(r.group_name if timeout_s is not None else None, question, answer, timeout)
    return pick, est


def _ranks_disagree(regions: list[CapacityRegion], picks: list, setting: str, timeout_s: float | None) -> str | None:
    """Why no rank may rewrite: the ranks' decisions differ (a rank that chunks its exchanges while
    another does not would run different collectives).  None: they agree, or no check."""
    from torch_commopt.core import consistency

    if timeout_s is None or consistency.check_skipped_reason() is not None:
        return None
    value = consistency.digest(sorted(str((r.summary(), c)) for r, (c, _) in zip(regions, picks)))
    # the graph's regions and the setting they are decided under (one process may compile one
    # graph under several), not the picks
    key = consistency.digest(sorted(r.summary() for r in regions) + [setting])
    decision = consistency.Decision("moe", regions[0].group_name, key, "capacity MoE rewrite")
    outcome = consistency.agree(decision, value, timeout_s)
    return None if outcome.agreed else f"moe NOT rewritten on any rank: {outcome.detail}"
