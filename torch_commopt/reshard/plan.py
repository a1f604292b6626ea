"""One choice per region for a whole graph under a per-GPU memory budget (Config.memory_budget_mib).

Each region's ranked candidates (the cost model's predicted ms and extra MiB, as explain lists
them) become the options of a node of `search.Problem`; the layouts between regions are fixed
by the program today, so no edge costs anything and the budget is what couples the regions.
The search then finds the fastest set of choices whose extra memory fits, exactly.
"""

from __future__ import annotations

import logging
import math

from torch_commopt.reshard.search import InfeasibleBudget, Plan, Problem, least_memory, runner_up, solve

log = logging.getLogger("torch_commopt.reshard.plan")


def choose_within_budget(candidates: dict[str, list[dict]], budget_mib: float) -> tuple[dict[str, int], str]:
    """({region: index into its candidate rows}, a note for explain).

    candidates: per region, rows with "predicted_ms" and "extra_mib".  A budget no plan fits
    gives the least-memory plan, logged (a compile must not fail over it)."""
    problem = _problem(candidates)
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


def describe_plan(candidates: dict[str, list[dict]], chosen: dict[str, str], budget_mib: float | None) -> list[str]:
    """explain's plan view: the chosen schedules' total predicted time and extra memory, and
    the runner-up (the best other set of choices within the budget) with what it changes.
    chosen: per region the schedule it runs (regions whose schedule is not among its ranked
    candidates, e.g. an autotune placeholder not yet timed, leave the view out)."""
    if not candidates or any(chosen.get(n) not in [r["schedule"] for r in rows] for n, rows in candidates.items()):
        return []
    problem = _problem(candidates)
    index = {n: [r["schedule"] for r in rows].index(chosen[n]) for n, rows in candidates.items()}
    plan = Plan(index, *problem.cost(index))
    budget = math.inf if budget_mib is None else budget_mib
    lines = [f"{len(candidates)} region(s), predicted {plan.time:.3f} ms, {plan.memory:.0f} MiB extra"
             + ("" if budget_mib is None else f" (budget {budget_mib:g} MiB)")]
    other = runner_up(problem, plan, max(budget, plan.memory))
    if other is None:
        lines.append("runner-up: none (one candidate per region)")
    else:
        changes = ", ".join(f"{n} {candidates[n][i]['schedule']}" for n, i in other.choice.items() if i != index[n])
        lines.append(f"runner-up: {changes}: predicted {other.time:.3f} ms ({other.time - plan.time:+.3f}), "
                     f"{other.memory:.0f} MiB extra")
    return lines


def _problem(candidates: dict[str, list[dict]]) -> Problem:
    """One node per region, its candidate rows' (predicted ms, extra MiB) as options."""
    return Problem({name: [(row["predicted_ms"], row["extra_mib"]) for row in rows] for name, rows in candidates.items()})
