"""What commopt did to each compiled graph (and to each module it rewrote: an MoE layer's token
exchange), as data and as a printed table.

    import torch_commopt
    torch_commopt.reset_explain()
    ...run the compiled model...
    report = torch_commopt.explain()     # ExplainReport
    print(report)                        # the table
    report.to_dict()                     # JSON-able data

Graphs served from Inductor's FX cache do not run the pass and are not listed (the
backend turns that cache off by default; see Config.fx_graph_cache).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from torch_commopt.core.schedule import Schedule


@dataclass(frozen=True)
class Skip:
    """A candidate left untouched: the pattern it looked like, the node, and why."""

    kind: str
    node: str
    reason: str


@dataclass
class RegionReport:
    kind: str
    collective: str
    summary: dict[str, Any]
    schedule: str
    status: str


@dataclass
class GraphReport:
    graph_id: int
    graph_kind: str
    compile_id: str | None
    regions: list[RegionReport] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    collectives_before: dict[str, int] = field(default_factory=dict)
    collectives_after: dict[str, int] = field(default_factory=dict)
    commopt_ops: dict[str, int] = field(default_factory=dict)
    plan_hash: str = ""
    code: str | None = None
    # per collective node: the ranked candidates of Config.mode="model"
    # ({"schedule", "predicted_ms", "measured_ms", "extra_mib"}), best first
    candidates: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # the region DAG: "producer (out layout) -> consumer (in layout) via ops; reshard: kind"
    edges: list[str] = field(default_factory=list)
    # the whole-graph plan (modes model/autotune): total predicted time and memory, runner-up
    plan: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> list[RegionReport]:
        return [r for r in self.regions if r.status == "rewritten"]


@dataclass
class ModuleReport:
    """A rewrite of a module rather than of a graph (an MoE layer's token exchange, kernels/moe)."""

    module: str  # its name in the module given to optimize (or the recipe's model)
    kind: str  # "moe"
    detail: str  # what it runs now


@dataclass
class ExplainReport:
    graphs: list[GraphReport]
    modules: list[ModuleReport] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"graphs": [dataclasses.asdict(g) for g in self.graphs],
                "modules": [dataclasses.asdict(m) for m in self.modules]}

    def table(self) -> str:
        parts = [_graph_table(g) for g in self.graphs]
        if self.modules:
            parts.append("commopt modules:\n" + "\n".join(f"  {m.module} ({m.kind}): {m.detail}" for m in self.modules))
        return "\n".join(parts) or "commopt: no graph compiled yet"

    def __str__(self) -> str:
        return self.table()


_LOCK = threading.Lock()
_REPORTS: list[GraphReport] = []


_MODULES: list[ModuleReport] = []


def record(report: GraphReport) -> None:
    with _LOCK:
        _REPORTS.append(report)


def record_module(report: ModuleReport) -> None:
    with _LOCK:
        _MODULES.append(report)


def next_graph_id() -> int:
    with _LOCK:
        return len(_REPORTS)


def explain() -> ExplainReport:
    """The reports of every graph the commopt pass has seen, and of every module rewritten, in this
    process since the last reset."""
    with _LOCK:
        return ExplainReport(list(_REPORTS), list(_MODULES))


def reset_explain() -> None:
    with _LOCK:
        _REPORTS.clear()
        _MODULES.clear()


_COLUMNS = ("region", "collective", "world", "dim", "A (local)", "weights", "dtype", "keep A", "layouts", "schedule", "status")


def _row(r: RegionReport) -> tuple[str, ...]:
    s = r.summary
    weights = " ".join("x".join(map(str, w)) for w in s["weights"])
    return (r.kind, r.collective, str(s["world"]), "-" if s["dim"] is None else str(s["dim"]),
            "x".join(map(str, s["a_shape"])), weights, s["dtype"], "yes" if s["keep_gathered"] else "no",
            s["layouts"], r.schedule, r.status)


def _format(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


def _chosen(g: GraphReport, node: str, cands: list[dict[str, Any]]) -> str | None:
    """The candidate the region runs: its schedule, or (an autotune placeholder) the fastest
    measured one once the first call has timed them (schedule strings without debug params)."""
    schedule = next((r.schedule for r in g.regions if r.collective == node), None)
    if schedule is not None and schedule.startswith("autotune"):
        timed = [c for c in cands if c.get("measured_ms") is not None]
        return min(timed, key=lambda c: c["measured_ms"])["schedule"] if timed else None
    if schedule is None:
        return None
    return str(Schedule.parse(schedule).without_debug())


def _graph_table(g: GraphReport) -> str:
    head = (f"commopt graph {g.graph_id} ({g.graph_kind}, compile {g.compile_id}): "
            f"{len(g.rewritten)} region(s) rewritten, {len(g.regions) - len(g.rewritten)} kept as compiled, "
            f"{len(g.skipped)} candidate(s) skipped")
    lines = [head]
    if g.regions:
        lines += _format([_COLUMNS] + [_row(r) for r in g.regions])
    for node, cands in g.candidates.items():
        chosen = _chosen(g, node, cands)
        cells = ", ".join(("*" if c["schedule"] == chosen else "") + f"{c['schedule']} {c['predicted_ms']:.3f}"
                          + ("" if c.get("measured_ms") is None else f"/{c['measured_ms']:.3f}") for c in cands)
        lines.append(f"  candidates of {node} (predicted[/measured] ms, best predicted first, *chosen): {cells}")
    lines += [f"  edge {e}" for e in g.edges]
    lines += [f"  plan: {p}" for p in g.plan]
    lines += [f"  skipped {s.kind} at {s.node}: {s.reason}" for s in g.skipped]
    lines += [f"  note: {n}" for n in g.notes]
    lines.append(f"  collectives before {dict(g.collectives_before)} -> after {dict(g.collectives_after)}; "
                 f"commopt ops {dict(g.commopt_ops)}; plan {g.plan_hash}")
    return "\n".join(lines)
