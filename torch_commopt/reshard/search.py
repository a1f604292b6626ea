"""Exact plan search on a region DAG: one option per region, minimum total time, memory budget.

The problem: every node (a region, or a pointwise op whose layout is a choice) has options,
each with a time and a memory; every edge u -> v has a table of (time, memory) for each pair
(option of u, option of v) -- the resharding between u's output layout and v's input layout.
Minimize the total time subject to total memory <= budget.  Memory is additive here (saved
activations and buffers of the chosen options live together).

Method: variable elimination on the interaction graph (min-degree order, exact for any
graph; its cost grows with the graph's width, which is small for layer stacks with residual
connections; a graph whose elimination would build tables larger than `max_table` entries
goes to the integer program in `reshard.ilp` instead, also exact), where every table entry is a
Pareto front of (time, memory) pairs instead of a
single number: pairs over the budget are dropped as soon as they appear (memory is never
negative), dominated pairs as soon as they are found.  Without a budget every front has one
pair and this is ordinary min-sum elimination.  Each pair keeps the choices that made it, so
the argmin comes back with the optimum.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from torch_commopt.reshard.problem import InfeasibleBudget, Plan, Problem

# A front: Pareto pairs (time, memory, choices), memory ascending, time strictly descending.
# `choices` is a nested tuple of (node, option) pairs, flattened only for the answer.
Front = list[tuple[float, float, tuple]]


def _prune(pairs, budget: float) -> Front:
    out: Front = []
    for t, m, c in sorted(pairs, key=lambda p: (p[1], p[0])):
        if m > budget:
            break
        if not out or t < out[-1][0]:
            out.append((t, m, c))
    return out


def _plus(a: Front, b: Front, budget: float) -> Front:
    if len(a) == 1 and len(b) == 1:  # the common case without a budget: no sorting
        (ta, ma, ca), (tb, mb, cb) = a[0], b[0]
        return [(ta + tb, ma + mb, (ca, cb))] if ma + mb <= budget else []
    return _prune(((ta + tb, ma + mb, (ca, cb)) for ta, ma, ca in a for tb, mb, cb in b), budget)


@dataclass
class _Factor:
    scope: tuple[str, ...]
    table: dict[tuple[int, ...], Front]


# Largest table (entries) variable elimination may build before the ILP takes over.
MAX_TABLE = 1 << 16


def solve(problem: Problem, budget: float = math.inf, *, max_table: int = MAX_TABLE) -> Plan:
    """The exact minimum-time plan within `budget` (raises InfeasibleBudget if none fits)."""
    order, largest = _elimination_order(problem)
    if largest > max_table:
        from torch_commopt.reshard.ilp import solve_ilp

        return solve_ilp(problem, budget)
    factors = [_Factor((n,), {(i,): [(t, m, ((n, i),))] for i, (t, m) in enumerate(opts)})
               for n, opts in problem.options.items()]
    for (u, v), table in problem.edges.items():
        if u == v:
            raise ValueError(f"plan search: self-edge on {u!r}")
        factors.append(_Factor((u, v), {(i, j): [(t, m, ())] for i, row in enumerate(table)
                                        for j, (t, m) in enumerate(row)}))
    sizes = {n: len(o) for n, o in problem.options.items()}
    for var in order:
        touching = [f for f in factors if var in f.scope]
        factors = [f for f in factors if var not in f.scope]
        factors.append(_eliminate(var, touching, sizes, budget))
    total: Front = [(0.0, 0.0, ())]
    for f in factors:  # all scopes are empty now
        total = _plus(total, f.table[()], budget)
    if not total:  # only a finite budget can leave nothing
        raise InfeasibleBudget(budget, least_memory(problem).memory)
    t, m, choices = min(total, key=lambda p: (p[0], p[1]))
    choice = dict(_flatten(choices))
    return Plan(choice, *problem.cost(choice))


def runner_up(problem: Problem, best: Plan, budget: float = math.inf) -> Plan | None:
    """The best plan other than `best` (None when `best` is the only one within the budget).
    Exact: any other plan differs from `best` at some node, so it is among the optima with
    one node held to one of its other options."""
    found = None
    for node, opts in problem.options.items():
        for i in range(len(opts)):
            if i == best.choice[node]:
                continue
            held = Problem({**problem.options, node: [opts[i]]},
                           {e: ([table[i]] if e[0] == node else [[row[i]] for row in table] if e[1] == node else table)
                            for e, table in problem.edges.items()})
            try:
                plan = solve(held, budget)
            except InfeasibleBudget:
                continue
            choice = {**plan.choice, node: i}
            t, m = problem.cost(choice)
            if found is None or (t, m) < (found.time, found.memory):
                found = Plan(choice, t, m, plan.method)
    return found


def least_memory(problem: Problem) -> Plan:
    """The plan with the least memory (ties: the least time)."""
    swapped = Problem({n: [(m, t) for t, m in o] for n, o in problem.options.items()},
                      {e: [[(m, t) for t, m in row] for row in table] for e, table in problem.edges.items()})
    plan = solve(swapped)
    return Plan(plan.choice, *problem.cost(plan.choice), method=plan.method)


def _eliminate(var: str, touching: list[_Factor], sizes: dict[str, int], budget: float) -> _Factor:
    scope = tuple(sorted({n for f in touching for n in f.scope} - {var}))
    table: dict[tuple[int, ...], Front] = {}
    for assignment in itertools.product(*(range(sizes[n]) for n in scope)):
        env = dict(zip(scope, assignment))
        merged: list = []
        for i in range(sizes[var]):
            env[var] = i
            front: Front = [(0.0, 0.0, ())]
            for f in touching:
                front = _plus(front, f.table[tuple(env[n] for n in f.scope)], budget)
                if not front:
                    break
            merged += front
        table[assignment] = _prune(merged, budget)
    return _Factor(scope, table)


def _elimination_order(problem: Problem) -> tuple[list[str], int]:
    """Greedy min-degree (ties: min fill, then name) on the interaction graph, and the
    largest table it builds (entries: the product of the option counts of a variable and
    its neighbours when it is eliminated)."""
    adj = {n: set() for n in problem.options}
    for u, v in problem.edges:
        adj[u].add(v)
        adj[v].add(u)
    order, largest = [], 1
    while adj:
        def key(n):
            nb = adj[n]
            fill = sum(1 for a, b in itertools.combinations(nb, 2) if b not in adj[a])
            return (len(nb), fill, n)

        var = min(adj, key=key)
        nb = adj.pop(var)
        largest = max(largest, math.prod(len(problem.options[n]) for n in nb | {var}))
        for a in nb:
            adj[a].discard(var)
            adj[a] |= nb - {a}
        order.append(var)
    return order, largest


def _flatten(choices) -> list[tuple[str, int]]:
    out, stack = [], [choices]
    while stack:
        c = stack.pop()
        if not c:
            continue
        if isinstance(c[0], str):
            out.append(c)
        else:
            stack.extend(c)
    return out


def brute_force(problem: Problem, budget: float = math.inf) -> Plan | None:
    """Every assignment (tests only: exponential)."""
    nodes = list(problem.options)
    best = None
    for combo in itertools.product(*(range(len(problem.options[n])) for n in nodes)):
        choice = dict(zip(nodes, combo))
        t, m = problem.cost(choice)
        if m <= budget and (best is None or (t, m) < (best.time, best.memory)):
            best = Plan(choice, t, m)
    return best
