"""The plan search against brute force on random DAGs, and its memory-budget behaviour."""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import random
import subprocess
import sys

import pytest

from torch_commopt.reshard.problem import InfeasibleBudget, Problem
from torch_commopt.reshard.search import brute_force, least_memory, runner_up, solve


def random_dag(rng: random.Random, nodes: int, max_options: int, max_combos: int = 60_000) -> Problem:
    """A random DAG (edges only forward, so several consumers and skip connections occur),
    random times and memories; option counts kept so brute force stays affordable."""
    names = [f"r{i}" for i in range(nodes)]
    counts = [rng.randint(1, max_options) for _ in names]
    while math.prod(counts) > max_combos:
        counts[counts.index(max(counts))] -= 1
    options = {n: [(rng.uniform(0, 10), rng.choice([0, 1, 2, 4, 8]) * rng.uniform(0.5, 1.5)) for _ in range(c)]
               for n, c in zip(names, counts)}
    edges = {}
    for j in range(1, nodes):
        for i in rng.sample(range(j), k=min(j, rng.randint(1, 3))):
            u, v = names[i], names[j]
            edges[(u, v)] = [[(rng.choice([0.0, rng.uniform(0, 5)]), rng.choice([0.0, rng.uniform(0, 3)]))
                              for _ in range(counts[j])] for _ in range(counts[i])]
    return Problem(options, edges)


@pytest.mark.parametrize("seed", range(40))
def test_search_equals_brute_force_on_random_dags(seed):
    rng = random.Random(seed)
    problem = random_dag(rng, nodes=rng.randint(2, 12), max_options=4)
    best = brute_force(problem)
    got = solve(problem)
    assert got.time == pytest.approx(best.time, rel=1e-12, abs=1e-12)
    assert problem.cost(got.choice) == pytest.approx((got.time, got.memory))
    # a budget between the least-memory plan and the unconstrained optimum's memory
    low = least_memory(problem).memory
    budget = low + rng.uniform(0, 1) * max(0.0, got.memory - low)
    bounded_best = brute_force(problem, budget)
    bounded = solve(problem, budget)
    assert bounded.memory <= budget + 1e-9
    assert bounded.time == pytest.approx(bounded_best.time, rel=1e-12, abs=1e-12)


def test_least_memory_plan_and_infeasible_budget():
    rng = random.Random(7)
    problem = random_dag(rng, nodes=8, max_options=3)
    least = least_memory(problem)
    nodes = list(problem.options)
    every = [problem.cost(dict(zip(nodes, c)))[1]
             for c in itertools.product(*(range(len(problem.options[n])) for n in nodes))]
    assert least.memory == pytest.approx(min(every))
    with pytest.raises(InfeasibleBudget, match="the least any plan needs") as err:
        solve(problem, least.memory * 0.5 - 1e-6 if least.memory > 0 else -1.0)
    assert err.value.least_memory == pytest.approx(least.memory)


@pytest.mark.parametrize("seed", range(12))
def test_ilp_fallback_equals_brute_force(seed):
    # max_table=1 sends every graph with an edge to the integer program
    rng = random.Random(100 + seed)
    problem = random_dag(rng, nodes=rng.randint(3, 10), max_options=4, max_combos=20_000)
    best = brute_force(problem)
    got = solve(problem, max_table=1)
    assert got.method == "ilp"
    assert got.time == pytest.approx(best.time, rel=1e-9, abs=1e-9)
    low = least_memory(problem).memory
    budget = low + rng.uniform(0, 1) * max(0.0, got.memory - low)
    bounded = solve(problem, budget, max_table=1)
    assert bounded.memory <= budget + 1e-6
    assert bounded.time == pytest.approx(brute_force(problem, budget).time, rel=1e-9, abs=1e-9)
    with pytest.raises(InfeasibleBudget) as err:
        solve(problem, low - 1.0, max_table=1)
    assert err.value.least_memory == pytest.approx(low, abs=1e-9)


def test_a_dense_graph_goes_to_the_ilp_and_stays_exact():
    # every region feeds every later one: elimination would build a 4^12-entry table
    rng = random.Random(3)
    names = [f"r{i}" for i in range(13)]
    options = {n: [(rng.uniform(0, 10), 0.0) for _ in range(4)] for n in names}
    edges = {(u, v): [[(rng.uniform(0, 1), 0.0) for _ in range(4)] for _ in range(4)]
             for i, u in enumerate(names) for v in names[i + 1:]}
    problem = Problem(options, edges)
    got = solve(problem)
    assert got.method == "ilp"
    # the optimum cannot be beaten by any single-node change (a cheap exactness check)
    for n in names:
        for i in range(4):
            assert problem.cost({**got.choice, n: i})[0] >= got.time - 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_runner_up_is_the_second_best_plan(seed):
    rng = random.Random(500 + seed)
    problem = random_dag(rng, nodes=rng.randint(2, 8), max_options=3, max_combos=3_000)
    nodes = list(problem.options)
    plans = sorted(problem.cost(dict(zip(nodes, c))) for c in itertools.product(*(range(len(problem.options[n]))
                                                                                    for n in nodes)))
    best = solve(problem)
    second = runner_up(problem, best)
    if len(plans) == 1:
        assert second is None
    else:
        assert second.choice != best.choice
        assert second.time == pytest.approx(plans[1][0], rel=1e-12, abs=1e-12)


def test_bad_problems_are_rejected():
    with pytest.raises(ValueError, match="no options"):
        Problem({"a": []})
    with pytest.raises(ValueError, match="not 2x1"):
        Problem({"a": [(1, 0), (2, 0)], "b": [(1, 0)]}, {("a", "b"): [[(0, 0)]]})
    with pytest.raises(ValueError, match="unknown node"):
        Problem({"a": [(1, 0)]}, {("a", "c"): [[(0, 0)]]})


def test_llama_stack_search_is_exact_and_fast():
    """The benchmark's TP+SP layer stack (residual connections, several consumers): exact on
    one layer against brute force; 32 layers (128 regions) planned within the budget."""
    from benchmarks.bench_search import llama_problem

    one, regions = llama_problem(1)
    assert regions == 4
    best = brute_force(one)
    assert solve(one).time == pytest.approx(best.time, rel=1e-12)
    low = least_memory(one).memory
    budget = (low + best.memory) / 2
    assert solve(one, budget).time == pytest.approx(brute_force(one, budget).time, rel=1e-12)
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_search"], cwd=root, capture_output=True, text=True,
                         timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["regions"] >= 128 and result["budget_plan_mib"] <= result["budget_mib"] + 1e-6
