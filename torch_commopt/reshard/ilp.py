"""The plan search as an integer program, for region graphs too wide to eliminate.

Variables: x[n, i] = 1 when node n takes option i; y[e, i, j] = 1 when edge e = (u, v) sees
u's option i and v's option j.  One option per node (sum_i x[n, i] = 1); y is tied to x by
its marginals (sum_j y[e, i, j] = x[u, i], sum_i y[e, i, j] = x[v, j]), which with binary
variables makes y exactly the product x[u, i] * x[v, j].  Minimize the time of the chosen
options and edge entries; memory (same sums) <= budget.  Solved by scipy's `milp` (HiGHS).
"""

from __future__ import annotations

import math

from torch_commopt.reshard.problem import InfeasibleBudget, Plan, Problem


def solve_ilp(problem: Problem, budget: float = math.inf, *, time_limit_s: float = 60.0) -> Plan:
    """The exact minimum-time plan within `budget` (raises InfeasibleBudget if none fits)."""
    plan = _milp(problem, budget, time_limit_s, minimize="time")
    if plan is None:
        least = _milp(problem, math.inf, time_limit_s, minimize="memory")
        raise InfeasibleBudget(budget, least.memory)
    return plan


def _milp(problem: Problem, budget: float, time_limit_s: float, *, minimize: str) -> Plan | None:
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as e:  # pragma: no cover - scipy is a declared dependency of this path
        raise RuntimeError("plan search: this region graph is too wide for exact elimination and the ILP "
                           "fallback needs scipy (pip install 'torch_commopt[ilp]')") from e
    nodes = list(problem.options)
    col: dict[tuple, int] = {}
    time, memory = [], []
    for n in nodes:
        for i, (t, m) in enumerate(problem.options[n]):
            col[("x", n, i)] = len(time)
            time.append(t)
            memory.append(m)
    for e, table in problem.edges.items():
        for i, row in enumerate(table):
            for j, (t, m) in enumerate(row):
                col[("y", e, i, j)] = len(time)
                time.append(t)
                memory.append(m)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def equation(terms: list[tuple[int, float]], value: float) -> None:
        r = len(lo)
        for c, v in terms:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(value)
        hi.append(value)

    for n in nodes:  # one option per node
        equation([(col[("x", n, i)], 1.0) for i in range(len(problem.options[n]))], 1.0)
    for (u, v), table in problem.edges.items():  # y's marginals are x
        for i in range(len(table)):
            equation([(col[("y", (u, v), i, j)], 1.0) for j in range(len(table[i]))] + [(col[("x", u, i)], -1.0)], 0.0)
        for j in range(len(table[0])):
            equation([(col[("y", (u, v), i, j)], 1.0) for i in range(len(table))] + [(col[("x", v, j)], -1.0)], 0.0)
    if math.isfinite(budget):
        r = len(lo)
        rows += [r] * len(memory)
        cols += list(range(len(memory)))
        vals += memory
        lo.append(-np.inf)
        hi.append(budget)
    a = coo_array((vals, (rows, cols)), shape=(len(lo), len(time))).tocsr()
    objective = np.array(time if minimize == "time" else memory, dtype=float)
    # Ties: the other quantity, scaled far below any difference that matters.
    other = np.array(memory if minimize == "time" else time, dtype=float)
    scale = 1e-9 * (np.abs(objective).sum() + 1.0) / (np.abs(other).sum() + 1.0)
    result = milp(objective + scale * other, constraints=LinearConstraint(a, lo, hi),
                  integrality=np.ones(len(time)), bounds=Bounds(0, 1),
                  options={"time_limit": time_limit_s})
    if result.status == 2:  # infeasible
        return None
    if result.x is None or not result.success:
        raise RuntimeError(f"plan search: the ILP solver did not finish ({result.message})")
    choice = {n: max(range(len(problem.options[n])), key=lambda i: result.x[col[("x", n, i)]]) for n in nodes}
    return Plan(choice, *problem.cost(choice), method="ilp")
