"""One choice per region for a whole graph under a per-GPU memory budget (Config.memory_budget_mib).

Each region's ranked candidates (the cost model's predicted ms and extra MiB, as explain lists
them) become the options of a node of `search.Problem`; the layouts between regions are fixed
by the program today, so no edge costs anything and the budget is what couples the regions.
The search then finds the fastest set of choices whose extra memory fits, exactly.

What "fastest" means for a graph: a region's predicted time for back-to-back calls of it alone
is max(device time, host time) -- a short GPU schedule is host-bound there.  Inside a compiled
graph the host enqueues the whole graph while the GPU works, so the graph takes the longer of
the summed device times and the summed host times, not the sum of the per-region maxima
(2x H200, a TP+SP block fwd+bwd: ranking regions alone chose `chunked:2` for its short
reduce-scatters, 12.70 ms a step, against 11.94 ms with `ce_push:1` everywhere).
`choose_for_graph` therefore minimizes the summed device time and keeps that plan while its
summed host time stays under it; otherwise the graph is host-bound and the per-region times
decide, as before.
"""

from __future__ import annotations

import logging
import math

from torch_commopt.reshard.search import InfeasibleBudget, Plan, Problem, least_memory, runner_up, solve

log = logging.getLogger("torch_commopt.reshard.plan")


def choose_within_budget(candidates: dict[str, list[dict]], budget_mib: float,
                         key: str = "predicted_ms") -> tuple[dict[str, int], str]:
    """({region: index into its candidate rows}, a note for explain).

    candidates: per region, rows with "predicted_ms" and "extra_mib".  A budget no plan fits
    gives the least-memory plan, logged (a compile must not fail over it)."""
    problem = _problem(candidates, key)
    try:
        plan = solve(problem, budget_mib)
        fastest = solve(problem)
        note = (f"plan within {budget_mib:g} MiB: predicted {plan.time:.3f} ms, {plan.memory:.0f} MiB extra "
                f"(unconstrained: {fastest.time:.3f} ms, {fastest.memory:.0f} MiB)")
    except InfeasibleBudget as e:
        plan = least_memory(problem)
        note = (f"no plan fits {budget_mib:g} MiB (the least is {e.least_memory:.0f} MiB): running the "
                f"least-memory plan, predicted {plan.time:.3f} ms")
        log.warning("commopt: %s", note)
    return plan.choice, note


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
        return solve(_problem(candidates, key)).choice, ""
    return choose_within_budget(candidates, budget_mib, key)


def describe_plan(candidates: dict[str, list[dict]], chosen: dict[str, str], budget_mib: float | None,
                  key: str = "predicted_ms") -> list[str]:
    """explain's plan view: the chosen schedules' total predicted time and extra memory, and
    the runner-up (the best other set of choices within the budget) with what it changes.
    chosen: per region the schedule it runs (regions whose schedule is not among its ranked
    candidates, e.g. an autotune placeholder not yet timed, leave the view out)."""
    if not candidates or not _decided(candidates, chosen):
        return []
    problem = _problem(candidates, key)
    index = {n: [r["schedule"] for r in rows].index(chosen[n]) for n, rows in candidates.items()}
    plan = Plan(index, *problem.cost(index))
    budget = math.inf if budget_mib is None else budget_mib
    what = "device time" if key == "gpu_ms" else "predicted"
    lines = [f"{len(candidates)} region(s), {what} {plan.time:.3f} ms, {plan.memory:.0f} MiB extra"
             + ("" if budget_mib is None else f" (budget {budget_mib:g} MiB)")]
    other = runner_up(problem, plan, max(budget, plan.memory))
    if other is None:
        lines.append("runner-up: none (one candidate per region)")
    else:
        changes = ", ".join(f"{n} {candidates[n][i]['schedule']}" for n, i in other.choice.items() if i != index[n])
        lines.append(f"runner-up: {changes}: predicted {other.time:.3f} ms ({other.time - plan.time:+.3f}), "
                     f"{other.memory:.0f} MiB extra")
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


def _problem(candidates: dict[str, list[dict]], key: str = "predicted_ms") -> Problem:
    """One node per region, its candidate rows' (row[key] ms, extra MiB) as options."""
    return Problem({name: [(row[key], row["extra_mib"]) for row in rows] for name, rows in candidates.items()})
