"""Per-process programs of the tuner tests (spawned, so they live in an importable module)."""

from __future__ import annotations

import torch.distributed as dist

from torch_commopt.tuner.cache import TunerCache
from torch_commopt.tuner.decide import DecisionMismatch, decide


def hammer_cache(root: str, writer: int, rounds: int) -> list[str]:
    """Write a shared key and an own key `rounds` times, reading both back each time.
    Returns the problems seen (a shared read must be some writer's complete value; an own
    read must be this writer's latest value)."""
    cache, problems = TunerCache(root), []
    shared = {"op": "ag_matmul", "M": 4096}
    for i in range(rounds):
        cache.put(shared, {"writer": writer, "round": i, "pad": "x" * 4096})
        cache.put({"own": writer}, {"round": i})
        got = cache.get(shared)
        if got is None or set(got) != {"writer", "round", "pad"} or len(got["pad"]) != 4096:
            problems.append(f"shared read {i}: {str(got)[:80]}")
        if cache.get({"own": writer}) != {"round": i}:
            problems.append(f"own read {i}")
    return problems


def decide_rounds(rank: int, world: int, mismatch_at: int | None):
    """Three decisions; rank 1 asks a different question at `mismatch_at`.
    Returns [(value or error text, whether this rank's answer() ran)]."""
    out = []
    for i in range(3):
        ran = []
        question = {"graph": i, "asker": rank if i == mismatch_at else 0}

        def answer(i=i):
            ran.append(True)
            return {"schedule": f"chunked:{2 + i}", "decided_by": rank}

        try:
            value = decide(dist.group.WORLD.group_name, question, answer, timeout_s=30)
        except DecisionMismatch as e:
            value = f"mismatch: {e}"
        out.append((value, bool(ran)))
    return out
