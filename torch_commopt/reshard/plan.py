"""One choice per region for a whole graph under a per-GPU memory budget (Config.memory_budget_mib).

Each region's ranked candidates (the cost model's predicted ms and extra MiB, as explain lists
them) become the options of a node of `search.Problem`; the layouts between regions are fixed
by the program today, so no edge costs anything and the budget is what couples the regions.
The search then finds the fastest set of choices whose extra memory fits, exactly.
"""

from __future__ import annotations

import logging

from torch_commopt.reshard.search import InfeasibleBudget, Problem, least_memory, solve

log = logging.getLogger("torch_commopt.reshard.plan")


def choose_within_budget(candidates: dict[str, list[dict]], budget_mib: float) -> tuple[dict[str, int], str]:
    """({region: index into its candidate rows}, a note for explain).

    candidates: per region, rows with "predicted_ms" and "extra_mib".  A budget no plan fits
    gives the least-memory plan, logged (a compile must not fail over it)."""
    problem = Problem({name: [(row["predicted_ms"], row["extra_mib"]) for row in rows]
                       for name, rows in candidates.items()})
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
