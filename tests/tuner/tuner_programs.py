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
            value = decide(dist.group.WORLD.group_name, question, answer, timeout_s=5)
        except DecisionMismatch as e:
            value = f"mismatch: {e}"
        out.append((value, bool(ran)))
    return out


def calibrate_program(rank: int, world: int, cache_dir: str):
    """Calibrate on gloo and store (outside any compile); (calibration JSON, seconds, seconds per
    phase as measure() logged them)."""
    import time

    import torch

    from torch_commopt.tuner import calibrate

    t0 = time.perf_counter()
    cal = calibrate.calibrate_and_store(dist.group.WORLD.group_name, torch.device("cpu"), cache_dir)
    return cal.to_json(), time.perf_counter() - t0, dict(calibrate.LAST_PHASES)


def compile_with_model(rank: int, world: int, cache_dir: str):
    """Compile AG -> mm with Config.mode="model" over gloo; returns what a test checks:
    (candidates of the region, chosen schedule, the pick's note, output error vs eager)."""
    import torch
    import torch.distributed._functional_collectives as funcol

    import torch_commopt

    torch.manual_seed(rank)
    a, b = torch.randn(256, 64), torch.randn(64, 48)

    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD) @ b

    torch_commopt.reset_explain()
    got = torch.compile(fn, backend="commopt", options={"mode": "model", "cache_dir": cache_dir})(a, b)
    want = fn(a, b)
    (graph,) = torch_commopt.explain().graphs
    (cands,) = graph.candidates.values()
    note = next(n for n in graph.notes if "model picked" in n)
    return cands, graph.regions[0].schedule, note, float((got - want).norm() / want.norm())  # rewritten or kept


def compile_with_autotune(rank: int, world: int, cache_dir: str):
    """Compile AG -> mm and mm -> RS with Config.mode="autotune" over gloo and run it twice.
    Called again in new processes, the cache is warm.  Returns, for the compile:
    (candidate rows, rewritten schedules, notes, output error vs eager, seconds of the
    first call (compile + timing) and of the second call)."""
    import time

    import torch
    import torch.distributed._functional_collectives as funcol

    import torch_commopt

    torch.manual_seed(rank)
    a, b, c = torch.randn(256, 64), torch.randn(64, 96), torch.randn(96, 32)

    def fn(a, b, c):
        h = funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD) @ b
        return funcol.reduce_scatter_tensor(torch.relu(h) @ c, "sum", scatter_dim=0, group=dist.group.WORLD)

    want = fn(a, b, c)
    out = []
    for _ in range(1):
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        compiled = torch.compile(fn, backend="commopt", options={"mode": "autotune", "cache_dir": cache_dir,
                                                                 "autotune_top_k": 2})
        t0 = time.perf_counter()
        got = compiled(a, b, c)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = compiled(a, b, c)
        second = time.perf_counter() - t0
        (graph,) = torch_commopt.explain().graphs
        err = max(float((g - want).norm() / want.norm()) for g in (got, again))
        out.append((graph.candidates, [r.schedule for r in graph.rewritten], list(graph.notes), err, first, second))
    return out


def compile_after_tune(rank: int, world: int, cache_dir: str):
    """AG -> mm and mm -> RS (shapes of the tune test) compiled with mode="autotune":
    (rewritten schedules, notes) -- a prefilled cache leaves nothing to time."""
    import torch
    import torch.distributed._functional_collectives as funcol

    import torch_commopt

    torch.manual_seed(rank)
    a, b, c = torch.randn(256, 64), torch.randn(64, 96), torch.randn(96, 32)

    def fn(a, b, c):
        h = funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD) @ b
        return funcol.reduce_scatter_tensor(h @ c, "sum", scatter_dim=0, group=dist.group.WORLD)

    torch_commopt.reset_explain()
    got = torch.compile(fn, backend="commopt", options={"mode": "autotune", "cache_dir": cache_dir,
                                                        "autotune_top_k": 2})(a, b, c)
    want = fn(a, b, c)
    (graph,) = torch_commopt.explain().graphs
    return [r.schedule for r in graph.rewritten], list(graph.notes), float((got - want).norm() / want.norm())


def compile_with_cache_fault(rank: int, world: int, base: str, fault: str):
    """compile_with_autotune with this rank's own cache directory under `base`: 'corrupt'
    (rank 0's entries overwritten with garbage: rank 0 answers for the group) or 'unwritable'
    (rank 0's directory cannot be created: a file stands where it would be)."""
    import pathlib

    mine = pathlib.Path(base) / f"rank{rank}"
    if rank == 0 and fault == "corrupt":
        for entry in mine.glob("*.json"):
            entry.write_text('{"version": 1, "key": {"truncated')
    if rank == 0 and fault == "unwritable":
        (pathlib.Path(base) / "blocker").write_text("a file where the cache directory would be")
        mine = pathlib.Path(base) / "blocker" / "cache"
    return compile_with_autotune(rank, world, str(mine))
