"""One choice per region for a whole graph under a per-GPU memory budget (Config.memory_budget_mib).

Each region's ranked candidates (the cost model's predicted ms and extra MiB, as explain lists
them) are the options; the layouts between regions are fixed by the program today, so no edge
costs anything and the budget is what couples the regions.

What a plan holds (`footprint`): the GPU schedules' symmetric buffers are allocated once per
size class and group and shared by every region whose request falls in a class already
there (kernels/gpu/symm.py), so they count once per distinct class ("pool_mib" rows: the
request), not once per region; everything else a schedule needs (staging, the unreduced
product, the gathered input of `sequential`) lives for one call and is freed before the next
region runs, so the largest of those counts.  Counting each class the plan's requests fall in
never counts less than the runtime allocates.  Summing every region's buffer instead would put
a TP+SP block at 640 MiB per graph where it holds one 128 MiB class, and a 400 MiB budget would
then keep regions on NCCL that fit (a plan slower than the all-NCCL one; docs/plan-search.md).
The search under a budget is exact for this count: one pass per set of allowed size
classes, each region taking its fastest candidate that the set and the room left allow.

What "fastest" means for a graph: a region's predicted time for back-to-back calls of it alone
is max(device time, host time) -- a short GPU schedule is host-bound there.  Inside a compiled
graph the host enqueues the whole graph while the GPU works, so the graph takes the longer of
the summed device times and the summed host times, not the sum of the per-region maxima
(a TP+SP block fwd+bwd: ranking regions alone chooses `chunked:2` for its short
reduce-scatters, 12.70 ms a step, against 11.94 ms with `ce_push:1` everywhere).
`choose_for_graph` therefore minimizes the summed device time and keeps that plan while its
summed host time stays under it; otherwise the graph is host-bound and the per-region times
decide, as before.
"""

from __future__ import annotations

import itertools
import logging
import math

log = logging.getLogger("torch_commopt.reshard.plan")


def candidate_rows(preds, device_split: bool) -> list[dict]:
    """A region's candidate rows (this module's options, explain's table) from the cost model's
    ranked predictions (tuner.model.Prediction); device_split: with the device / host times
    the whole-graph objective weighs (a GPU works while the host enqueues)."""
    rows = [{"schedule": str(p.schedule), "predicted_ms": p.seconds * 1e3, "measured_ms": None,
             "extra_mib": p.extra_bytes / 2**20, "pool_mib": p.pool_bytes / 2**20} for p in preds]
    if device_split:
        for row, p in zip(rows, preds):
            row.update(gpu_ms=p.gpu_s * 1e3, host_ms=p.host_s * 1e3)
    return rows


def choose_within_budget(candidates: dict[str, list[dict]], budget_mib: float,
                         key: str = "predicted_ms") -> tuple[dict[str, int], str]:
    """({region: index into its candidate rows}, a note for explain).

    candidates: per region, rows with `key`, "extra_mib" and (GPU schedules) "pool_mib".  A
    budget no plan fits gives the least-memory plan, logged (a compile must not fail over it)."""
    fastest = _fastest(candidates, key, lambda n, r: True)
    plan = _within(candidates, budget_mib, key)
    if plan is not None:
        note = (f"plan within {budget_mib:g} MiB: predicted {_time(candidates, plan, key):.3f} ms, "
                f"{footprint(candidates, plan):.0f} MiB extra (unconstrained: {_time(candidates, fastest, key):.3f} ms, "
                f"{footprint(candidates, fastest):.0f} MiB)")
        return plan, note
    plan = least_memory_plan(candidates, key)
    note = (f"no plan fits {budget_mib:g} MiB (the least is {footprint(candidates, plan):.0f} MiB): running the "
            f"least-memory plan, predicted {_time(candidates, plan, key):.3f} ms")
    log.warning("commopt: %s", note)
    return plan, note


def pool_class_mib(row: dict) -> float:
    """The size class (MiB) of the symmetric buffer a candidate requests; 0 without one."""
    from torch_commopt.kernels.gpu.symm import size_class

    pool = row.get("pool_mib", 0.0)
    return size_class(math.ceil(pool * 2**20)) / 2**20 if pool > 0 else 0.0


def transient_mib(row: dict) -> float:
    """What a candidate holds for one call only (its extra memory beyond the shared buffer)."""
    return max(0.0, row["extra_mib"] - row.get("pool_mib", 0.0))


def footprint(candidates: dict[str, list[dict]], choice: dict[str, int]) -> float:
    """MiB a plan holds: each distinct size class of its symmetric buffers once, plus the
    largest per-call need (module docstring)."""
    rows = [candidates[n][i] for n, i in choice.items()]
    classes = {c for c in map(pool_class_mib, rows) if c}
    return sum(classes) + max(map(transient_mib, rows), default=0.0)


def _time(candidates: dict[str, list[dict]], choice: dict[str, int], key: str) -> float:
    return sum(candidates[n][i][key] for n, i in choice.items())


def _fastest(candidates: dict[str, list[dict]], key: str, allowed) -> dict[str, int] | None:
    """Per region the fastest allowed row (ties: the least memory), None where a region has none."""
    choice = {}
    for n, rows in candidates.items():
        ok = [i for i, r in enumerate(rows) if allowed(n, r)]
        if not ok:
            return None
        choice[n] = min(ok, key=lambda i: (rows[i][key], transient_mib(rows[i]), pool_class_mib(rows[i])))
    return choice


def _class_sets(candidates: dict[str, list[dict]]):
    """Every set of the size classes the candidates request (the empty set first)."""
    classes = sorted({c for rows in candidates.values() for c in map(pool_class_mib, rows) if c})
    for k in range(len(classes) + 1):
        yield from itertools.combinations(classes, k)


def _within(candidates: dict[str, list[dict]], budget_mib: float, key: str) -> dict[str, int] | None:
    """The fastest plan whose footprint fits the budget (ties: the least memory), or None.
    Exact: a plan's classes are some set S; given S, the regions are independent, each its
    fastest row whose class is in S and whose per-call need fits what S leaves."""
    best, best_rank = None, None
    for classes in _class_sets(candidates):
        room = budget_mib - sum(classes)
        if room < 0:
            continue
        allowed = set(classes)
        choice = _fastest(candidates, key, lambda n, r: (pool_class_mib(r) in allowed or not pool_class_mib(r))
                          and transient_mib(r) <= room)
        if choice is None:
            continue
        rank = (_time(candidates, choice, key), footprint(candidates, choice))
        if best_rank is None or rank < best_rank:
            best, best_rank = choice, rank
    return best


def least_memory_plan(candidates: dict[str, list[dict]], key: str = "predicted_ms") -> dict[str, int]:
    """The plan holding the least (ties: the fastest)."""
    best, best_rank = None, None
    for classes in _class_sets(candidates):
        allowed = set(classes)

        def fits(r):
            return pool_class_mib(r) in allowed or not pool_class_mib(r)
        need = max(min(transient_mib(r) for r in rows if fits(r)) if any(map(fits, rows)) else math.inf
                   for rows in candidates.values())
        if need == math.inf:
            continue
        choice = _fastest(candidates, key, lambda n, r: fits(r) and transient_mib(r) <= need)
        rank = (footprint(candidates, choice), _time(candidates, choice, key))
        if best_rank is None or rank < best_rank:
            best, best_rank = choice, rank
    return best


def choose_for_graph(candidates: dict[str, list[dict]], budget_mib: float | None) -> tuple[dict[str, int], str, str]:
    """({region: index into its rows}, note, the row key the plan was chosen by): the least
    summed device time ("gpu_ms") whose summed host time ("host_ms") does not exceed it, else
    the per-region times ("predicted_ms"); within the budget where one is given."""
    if all("gpu_ms" in r and "host_ms" in r for rows in candidates.values() for r in rows):
        choice, note = _choose(candidates, budget_mib, "gpu_ms")
        gpu = sum(candidates[n][i]["gpu_ms"] for n, i in choice.items())
        host = sum(candidates[n][i]["host_ms"] for n, i in choice.items())
        if host <= gpu:
            return choice, (f"plan by device time: {gpu:.3f} ms on the GPU, {host:.3f} ms of host enqueue "
                            f"(the host runs ahead)" + (f"; {note}" if note else "")), "gpu_ms"
        why = f"host-bound graph ({host:.3f} ms of host for {gpu:.3f} ms on the GPU): plan by per-region time"
    else:
        why = "plan by per-region time"
    choice, note = _choose(candidates, budget_mib, "predicted_ms")
    return choice, why + (f"; {note}" if note else ""), "predicted_ms"


def _choose(candidates: dict[str, list[dict]], budget_mib: float | None, key: str) -> tuple[dict[str, int], str]:
    if budget_mib is None:
        return _fastest(candidates, key, lambda n, r: True), ""
    return choose_within_budget(candidates, budget_mib, key)


def describe_plan(candidates: dict[str, list[dict]], chosen: dict[str, str], budget_mib: float | None,
                  key: str = "predicted_ms") -> list[str]:
    """explain's plan view: the chosen schedules' total predicted time and extra memory
    (`footprint`), and the runner-up: the best plan within the budget that differs in one
    region, with what it changes.  chosen: per region the schedule it runs (regions whose
    schedule is not among its ranked candidates, e.g. an autotune placeholder not yet timed,
    leave the view out)."""
    if not candidates or not _decided(candidates, chosen):
        return []
    index = {n: [r["schedule"] for r in rows].index(chosen[n]) for n, rows in candidates.items()}
    time, memory = _time(candidates, index, key), footprint(candidates, index)
    budget = math.inf if budget_mib is None else budget_mib
    what = "device time" if key == "gpu_ms" else "predicted"
    lines = [f"{len(candidates)} region(s), {what} {time:.3f} ms, {memory:.0f} MiB extra"
             + ("" if budget_mib is None else f" (budget {budget_mib:g} MiB)")]
    others = [{**index, n: i} for n, rows in candidates.items() for i in range(len(rows)) if i != index[n]]
    others = [(_time(candidates, o, key), footprint(candidates, o), o) for o in others]
    others = [o for o in others if o[1] <= max(budget, memory)]
    if not others:
        lines.append("runner-up: none (one candidate per region)")
    else:
        t, m, other = min(others, key=lambda o: o[:2])
        changes = ", ".join(f"{n} {candidates[n][i]['schedule']}" for n, i in other.items() if i != index[n])
        lines.append(f"runner-up: {changes}: predicted {t:.3f} ms ({t - time:+.3f}), {m:.0f} MiB extra")
    return lines


def describe_edges(edges, candidates: dict[str, list[dict]], chosen: dict[str, str],
                   key: str = "predicted_ms") -> list[str]:
    """explain's line for the reshards between regions (dag.Edge: the program's own
    collectives outside every region, fixed whatever the regions choose) and the graph's
    total: the chosen schedules' time plus theirs."""
    if not edges or not _decided(candidates, chosen):
        return []
    costed = [e for e in edges if e.time_ms or e.mib]
    regions_ms = sum(next(r[key] for r in rows if r["schedule"] == chosen[n]) for n, rows in candidates.items())
    edges_ms = sum(e.time_ms for e in costed)
    return [f"edges: {len(edges)}, {len(costed)} with a reshard ({edges_ms:.3f} ms, "
            f"{max((e.mib for e in costed), default=0):.0f} MiB at most); graph total {regions_ms + edges_ms:.3f} ms"]


def _decided(candidates: dict[str, list[dict]], chosen: dict[str, str]) -> bool:
    """Whether every region runs one of its ranked candidates (not e.g. an untimed autotune
    placeholder)."""
    return all(chosen.get(n) in [r["schedule"] for r in rows] for n, rows in candidates.items())
