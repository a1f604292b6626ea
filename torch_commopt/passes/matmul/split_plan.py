"""The all-reduce splits of one graph, chosen together (Config.ar_split, ar_split_policy="cost").

One node per split candidate (passes/ar_split.find_ar_splits: a GEMM on both sides), with two
options, keep (Partial -> Replicate: a `matmul_ar` region) and split (Partial -> Shard -> ... ->
Replicate), priced by ar_cost.split_cost.  Candidates are not independent: a value that
candidate i would all-gather and that only candidate j's row-local ops use (the residual
stream from one block's all-reduce to the next one's) needs no gather when both split -- j
takes i's shard (split_all_reduces drops the gather).  That gather is therefore charged on
the edge i -> j, only for (i split, j kept), instead of in i's split option, and
search.solve finds the cheapest set of decisions on the resulting DAG exactly.  Deciding
each candidate alone charges every split for a gather that a split neighbour removes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from torch_commopt.passes.graph_utils import val
from torch_commopt.reshard.ar_cost import plain_gather_s, split_cost
from torch_commopt.reshard.problem import Problem
from torch_commopt.reshard.search import solve

KEEP, SPLIT = 0, 1


@dataclass(frozen=True)
class SplitPlan:
    split: dict[Node, bool]  # per candidate's all_reduce node: split it?
    why: dict[Node, str]  # per candidate: the note explain shows


def plan_splits(cands: list, world: int, cal) -> SplitPlan:
    """The exact joint decision over `cands` (SplitCandidates of one group of `world` ranks)."""
    from torch_commopt.passes.matmul.ar_split import split_shapes

    names = {c.all_reduce: f"{i}:{c.all_reduce.name}" for i, c in enumerate(cands)}
    options, edges, alone, shared = {}, {}, {}, {}
    for c in cands:
        cost = split_cost(split_shapes(c, world), cal)
        alone[c.all_reduce] = cost
        saved = 0.0
        for v, j in _handed_on(c, cands):
            ms = gather_ms(v, world, cal)
            saved += ms
            key = (names[c.all_reduce], names[j.all_reduce])
            table = edges.setdefault(key, [[(0.0, 0.0), (0.0, 0.0)], [(0.0, 0.0), (0.0, 0.0)]])
            t, m = table[SPLIT][KEEP]
            table[SPLIT][KEEP] = (t + ms, m)
            shared.setdefault(c.all_reduce, []).append(j.all_reduce.name)
        options[names[c.all_reduce]] = [(cost.keep_ms, 0.0), (cost.split_ms - saved, 0.0)]
    problem = Problem(options, edges)
    plan = solve(problem)
    split, why = {}, {}
    for c in cands:
        s = plan.choice[names[c.all_reduce]] == SPLIT
        split[c.all_reduce] = s
        cost = alone[c.all_reduce]
        with_next = f"; its residual gather goes if {', '.join(shared[c.all_reduce])} splits too" \
            if c.all_reduce in shared else ""
        why[c.all_reduce] = (f"{'split' if s else 'kept'} by the joint plan of {len(cands)} candidate(s) "
                             f"(predicted {plan.time:.3f} ms in all): alone {cost.split_ms:.3f} ms split vs "
                             f"{cost.keep_ms:.3f} ms as an all-reduce{with_next}")
    return SplitPlan(split, why)


def _handed_on(c, cands: list) -> list[tuple[Node, object]]:
    """(value, candidate j) for each value c would gather whose every user outside c is an
    op of one other candidate j that takes it as a full operand."""
    mine = set(c.ops)
    out = []
    for v in c.frontier:
        users = [u for u in v.users if u not in mine]
        for j in cands:
            if j is not c and users and v in j.full_operands and set(users) <= set(j.ops):
                out.append((v, j))
                break
    return out


def gather_ms(v: Node, world: int, cal) -> float:
    """What split_cost charged for gathering value v (its users are row-local ops, no GEMM)."""
    t = val(v)  # the whole rows: the graph is not split yet
    return plain_gather_s(t.numel() * t.element_size(), world, cal) * 1e3
