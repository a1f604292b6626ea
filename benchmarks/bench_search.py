"""Speed of the exact plan search (torch_commopt.reshard.search) on a Llama-style layer stack.

The problem is built the way the whole-graph planner sees a TP+SP transformer: per layer two
residual-stream nodes (residual add + RMSNorm, sequence-sharded S(0) or replicated R) and four
matmul-collective regions (q/k/v all-gather+matmul, attention output matmul+reduce-scatter or
all-reduce, w1/w3 all-gather+matmul, w2 matmul+reduce-scatter or all-reduce).  Region options
carry their layouts, the cost model's time (2x H200 priors) and the memory they keep for
backward (the sharded or the gathered input); edges carry the reshard between layouts
(reshard.layouts), residual connections included.  Prints one JSON line: regions, nodes,
edges, seconds to solve without and with a memory budget.

It also times what a compile runs on such a stack's graphs (reshard.plan.choose_for_graph, the
planner of Config(mode="model")): every forward and backward region of the stack with the
candidate rows the pass builds (tuner.matmul.choose.choose_by_model's predictions, 2x H200 priors;
no concat-K copy charges),
planned without a budget and within one between the least-memory and the unconstrained plan.

    taskset -c 0,1 python3 -m benchmarks.bench_search [--layers 32] [--out benchmarks/results]

With --out it also writes search_cpux<cores>_<date>.json (the cores it may run on).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit, result_stem, today  # noqa: E402
from torch_commopt.core.schedule import Schedule  # noqa: E402
from torch_commopt.reshard.layouts import Replicate, Shard, reshard  # noqa: E402
from torch_commopt.reshard.problem import Problem  # noqa: E402
from torch_commopt.reshard.search import least_memory, solve  # noqa: E402
from torch_commopt.tuner.calibration import prior  # noqa: E402
from torch_commopt.tuner.matmul.model import RegionShape, predict  # noqa: E402

HBM_BYTES_PER_S = 4.0e12


def llama_problem(layers: int, world: int = 2, tokens: int = 8192, dim: int = 4096, hidden: int = 14336,
                  kv_dim: int = 1024) -> tuple[Problem, int]:
    """(problem, number of matmul-collective regions) of a TP+SP Llama stack (bf16)."""
    cal, elt = prior("NVIDIA H200", world), 2
    act = tokens * dim * elt  # one residual-stream activation, unsharded
    S, R = Shard(0), Replicate()

    def region_options(kind, rows, k, n, in_bytes):
        """[(time, memory, input layout, output layout)] of one region."""
        out = []
        if kind == "ag_matmul":
            shape = RegionShape(kind, rows // world, k, (n,), world, "bfloat16")
            for sched in ("ce_push:1", "sequential"):
                t = predict(shape, Schedule.parse(sched), cal).seconds
                out.append((t, in_bytes / world, S, S))  # keep the shard for backward (re-gather)
                out.append((t * 0.98, in_bytes, S, S))  # keep the gathered input (no re-gather)
            local = RegionShape("matmul_rs", rows, k, (n,), 1, "bfloat16")
            out.append((predict(local, Schedule("sequential"), cal).seconds, in_bytes, R, S))  # input replicated
        else:
            shape = RegionShape(kind, rows, k, (n,), world, "bfloat16")
            for sched in ("ce_push:2", "sequential"):
                out.append((predict(shape, Schedule.parse(sched), cal).seconds, act / world, S, S))
            ar = RegionShape("matmul_ar", rows, k, (n,), world, "bfloat16")
            out.append((predict(ar, Schedule("sequential"), cal).seconds, act, S, R))
        return out

    options, layouts, edges = {}, {}, {}

    def node(name, opts):
        options[name] = [(t, m) for t, m, *_ in opts]
        layouts[name] = [tuple(o[2:]) for o in opts]  # (input layout, output layout)

    def edge(u, v, nbytes):
        table = []
        for _, out_u in layouts[u]:
            row = []
            for in_v, _ in layouts[v]:
                r = reshard(out_u, in_v, nbytes, world, cal)
                row.append((r.time, r.memory))
            table.append(row)
        edges[(u, v)] = table

    def stream(name):  # residual add + RMSNorm, sharded or replicated
        node(name, [(act / world * 3 / HBM_BYTES_PER_S, act / world, S, S),
                    (act * 3 / HBM_BYTES_PER_S, act, R, R)])

    stream("x0")
    regions = 0
    for i in range(layers):
        x, y, z = f"x{i}", f"y{i}", f"x{i + 1}"
        node(f"qkv{i}", region_options("ag_matmul", tokens, dim, (dim + 2 * kv_dim) // world, act))
        node(f"wo{i}", region_options("matmul_rs", tokens, dim // world, dim, act))
        stream(y)
        node(f"w13_{i}", region_options("ag_matmul", tokens, dim, 2 * hidden // world, act))
        node(f"w2_{i}", region_options("matmul_rs", tokens, hidden // world, dim, act))
        stream(z)
        regions += 4
        edge(x, f"qkv{i}", act)
        edges[(f"qkv{i}", f"wo{i}")] = [[(0.0, 0.0)] * len(options[f"wo{i}"]) for _ in options[f"qkv{i}"]]
        edge(f"wo{i}", y, act)
        edge(x, y, act)  # residual
        edge(y, f"w13_{i}", act)
        edges[(f"w13_{i}", f"w2_{i}")] = [[(0.0, 0.0)] * len(options[f"w2_{i}"]) for _ in options[f"w13_{i}"]]
        edge(f"w2_{i}", z, act)
        edge(y, z, act)  # residual
    return Problem(options, edges), regions


def compile_path_rows(layers: int, world: int = 2, tokens: int = 8192, dim: int = 4096, hidden: int = 14336,
                      kv_dim: int = 1024) -> dict[str, list[dict]]:
    """{region: candidate rows} as the compile pass builds them (passes.pipeline) for every
    forward and backward matmul-collective region of the TP+SP stack (bf16, GPU rows)."""
    from torch_commopt.reshard.plan import candidate_rows
    from torch_commopt.tuner.matmul.choose import choose_by_model
    from torch_commopt.tuner.matmul.model import RegionFacts

    cal, loc = prior("NVIDIA H200", world), tokens // world
    regions = {  # per layer: (kind, A shape, weight shapes); backward regions gather dY / reduce dX
        "qkv": ("ag_matmul", [loc, dim], [[dim, dim // world], [dim, kv_dim // world], [dim, kv_dim // world]]),
        "wo": ("matmul_rs", [tokens, dim // world], [[dim // world, dim]]),
        "w13": ("ag_matmul", [loc, dim], [[dim, hidden // world], [dim, hidden // world]]),
        "w2": ("matmul_rs", [tokens, hidden // world], [[hidden // world, dim]]),
        "w2_bwd": ("ag_matmul", [loc, dim], [[dim, hidden // world]]),
        "w13_bwd": ("matmul_rs", [tokens, 2 * hidden // world], [[2 * hidden // world, dim]]),
        "wo_bwd": ("ag_matmul", [loc, dim], [[dim, dim // world]]),
        "qkv_bwd": ("matmul_rs", [tokens, (dim + 2 * kv_dim) // world], [[(dim + 2 * kv_dim) // world, dim]]),
    }
    rows = {}
    for name, (kind, a, ws) in regions.items():
        _, preds, _ = choose_by_model(RegionFacts(kind, a, ws, 0, world, "bfloat16"), cal, 8)
        proto = candidate_rows(preds, device_split=True)
        for i in range(layers):
            rows[f"{name}{i}"] = [dict(r) for r in proto]
    return rows


def time_compile_planner(layers: int) -> dict:
    from torch_commopt.reshard.plan import choose_for_graph, footprint, least_memory_plan

    rows = compile_path_rows(layers)
    t0 = time.perf_counter()
    free, _, key = choose_for_graph(rows, None)
    unbounded = time.perf_counter() - t0
    low = footprint(rows, least_memory_plan(rows, key))
    budget = low + 0.5 * (footprint(rows, free) - low)
    t0 = time.perf_counter()
    bounded, _, _ = choose_for_graph(rows, budget)
    return {"compile_path_regions": len(rows), "compile_path_solve_s": unbounded,
            "compile_path_solve_with_budget_s": time.perf_counter() - t0,
            "compile_path_plan_mib": footprint(rows, free), "compile_path_budget_mib": budget,
            "compile_path_budget_plan_mib": footprint(rows, bounded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default=None, help="also write the result JSON into this folder")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    t0 = time.perf_counter()
    problem, regions = llama_problem(args.layers)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    free = solve(problem)
    unbounded = time.perf_counter() - t0
    low = least_memory(problem)
    budget = low.memory + 0.5 * (free.memory - low.memory)
    t0 = time.perf_counter()
    bounded = solve(problem, budget)
    with_budget = time.perf_counter() - t0
    result = {"layers": args.layers, "regions": regions, "nodes": len(problem.options),
              "edges": len(problem.edges), "build_s": built, "solve_s": unbounded,
              "solve_with_budget_s": with_budget, "plan_ms": free.time * 1e3,
              "plan_mib": free.memory / 2**20, "budget_mib": budget / 2**20,
              "budget_plan_ms": bounded.time * 1e3, "budget_plan_mib": bounded.memory / 2**20,
              "method": free.method, **time_compile_planner(args.layers)}
    print(json.dumps(result))
    if args.out:
        cores = len(os.sched_getaffinity(0))
        doc = {"command": "python3 " + " ".join(sys.argv), "machine": f"{platform.machine()}, {cores} cores",
               "date": today(), "commit": args.commit or git_commit(), "runs": [result]}
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{result_stem('search', 'cpu', cores)}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
