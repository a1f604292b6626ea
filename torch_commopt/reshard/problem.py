"""The plan search's problem and answer: per-node options, per-edge tables, and the chosen plan."""

from __future__ import annotations

from dataclasses import dataclass, field


class InfeasibleBudget(ValueError):
    """No plan fits the memory budget; `least_memory` is the smallest any plan needs."""

    def __init__(self, budget: float, least_memory: float):
        super().__init__(f"plan search: no plan fits the memory budget {budget:.6g}; "
                         f"the least any plan needs is {least_memory:.6g}")
        self.budget, self.least_memory = budget, least_memory


@dataclass
class Problem:
    """options[node] = [(time, memory), ...]; edges[(u, v)][i][j] = (time, memory)."""

    options: dict[str, list[tuple[float, float]]]
    edges: dict[tuple[str, str], list[list[tuple[float, float]]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for node, opts in self.options.items():
            if not opts:
                raise ValueError(f"plan search: node {node!r} has no options")
            if any(m < 0 for _, m in opts):
                raise ValueError(f"plan search: node {node!r} has a negative memory")
        for (u, v), table in self.edges.items():
            if u not in self.options or v not in self.options:
                raise ValueError(f"plan search: edge {u}->{v} names an unknown node")
            if len(table) != len(self.options[u]) or any(len(row) != len(self.options[v]) for row in table):
                raise ValueError(f"plan search: edge {u}->{v} table is not {len(self.options[u])}x{len(self.options[v])}")
            if any(m < 0 for row in table for _, m in row):
                raise ValueError(f"plan search: edge {u}->{v} has a negative memory")

    def cost(self, choice: dict[str, int]) -> tuple[float, float]:
        """(time, memory) of a full assignment."""
        t = sum(self.options[n][i][0] for n, i in choice.items())
        m = sum(self.options[n][i][1] for n, i in choice.items())
        for (u, v), table in self.edges.items():
            et, em = table[choice[u]][choice[v]]
            t, m = t + et, m + em
        return t, m


@dataclass(frozen=True)
class Plan:
    choice: dict[str, int]
    time: float
    memory: float
    method: str = "elimination"  # or "ilp"
