"""Where a step's time goes: one lane per GPU stream, from a torch.profiler trace.

`load(trace, label)` reads a Chrome trace (`torch.profiler.profile(...).export_chrome_trace`, or
the dict it holds) and keeps one step of it: the last `ProfilerStep#N` the GPU ran where the
trace has them, else everything the GPU ran.  Each GPU event is a span on its stream's lane,
of one kind: `nccl` (NCCL's kernels), `copy` (the copy engine: memcpy; memsets too) or `compute`
(every other kernel).  Regions are what the host ran the spans for: every commopt op
(`commopt::...`) and every `record_function` range; a region covers the GPU time of the kernels
and copies launched inside it (matched by the trace's correlation ids), its label the op's name
and, where the profiler recorded the op's inputs (`record_shapes=True`), its schedule.  Idle
gaps are the stretches of the step where no lane runs anything.

`render(steps, png, html)` draws the steps one above the other on one time scale (so that a
shorter step is visibly shorter): each lane's spans coloured by kind, the regions as labelled
bars above them, the idle gaps shaded; a PNG, and an HTML page holding the same picture as SVG
and a table of where the time went.  `python -m torch_commopt timeline TRACE [TRACE ...]`
does both from files.  matplotlib draws (an optional dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import html
import io
import json
import pathlib
import re
from dataclasses import dataclass, field

GPU_CATS = {"kernel": None, "gpu_memcpy": "copy", "gpu_memset": "copy"}
COLORS = {"compute": "#4878cf", "copy": "#e6a532", "nccl": "#d65f5f"}
MIN_GAP_US = 5.0  # idle stretches shorter than this are launch jitter, not gaps
SCHEDULE = re.compile(r"^[a-z_]+(:[a-z0-9_=.]+)*$")  # how a schedule name reads (e.g. "ce_push:2")


@dataclass(frozen=True)
class Span:
    lane: str
    kind: str
    start: float  # microseconds from the step's start
    end: float
    name: str


@dataclass(frozen=True)
class Region:
    label: str
    start: float
    end: float


@dataclass
class Step:
    label: str
    duration: float  # microseconds
    spans: list[Span] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)

    @property
    def lanes(self) -> list[str]:
        return sorted({s.lane for s in self.spans}, key=lambda lane: tuple(int(x) for x in lane.split()[1::2]))

    def summary(self) -> dict:
        """Milliseconds: the step, each kind's busy time (a kind's spans merged), the idle gaps."""
        busy = {kind: total_length(merge_intervals([(s.start, s.end) for s in self.spans if s.kind == kind])) / 1e3
                for kind in COLORS}
        return {"step_ms": self.duration / 1e3, **{f"{k}_ms": v for k, v in busy.items()},
                "idle_ms": sum(b - a for a, b in self.gaps) / 1e3, "gaps": len(self.gaps)}


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals, in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total_length(intervals: list[tuple[float, float]]) -> float:
    """The summed length of (start, end) intervals (disjoint ones: merge_intervals first)."""
    return sum(b - a for a, b in intervals)


def _kind(event: dict) -> str:
    fixed = GPU_CATS[event["cat"]]
    if fixed is not None:
        return fixed
    return "nccl" if "nccl" in event["name"].lower() else "compute"


def _window(events: list[dict]) -> tuple[float, float] | None:
    """The last ProfilerStep the GPU ran (its GPU annotation), if the trace has one."""
    steps = [e for e in events if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep#")]
    if not steps:
        return None
    last = max(steps, key=lambda e: e["ts"])
    return last["ts"], last["ts"] + last["dur"]


def _schedule(event: dict) -> str:
    """The schedule among an op's recorded inputs (record_shapes=True), else ''."""
    inputs = event.get("args", {}).get("Concrete Inputs") or []
    names = [str(x).strip("'\"") for x in inputs if isinstance(x, str)]
    return next((n for n in names if n and SCHEDULE.match(n) and n not in ("sum", "avg")), "")


def load(trace, label: str, min_gap_us: float = MIN_GAP_US) -> Step:
    """One step of a Chrome trace (a path or its dict) as a Step (module docstring)."""
    if not isinstance(trace, dict):
        trace = json.loads(pathlib.Path(trace).read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    if not gpu:
        raise ValueError(f"timeline {label!r}: the trace holds no GPU kernel or copy (profile with CUDA activities)")
    window = _window(events)
    if window is not None:
        gpu = [e for e in gpu if window[0] <= e["ts"] < window[1]]
    t0 = window[0] if window else min(e["ts"] for e in gpu)
    t1 = window[1] if window else max(e["ts"] + e["dur"] for e in gpu)
    step = Step(label, t1 - t0)
    by_correlation = {}
    for e in gpu:
        lane = f"GPU {e['pid']} stream {e['tid']}"
        span = Span(lane, _kind(e), e["ts"] - t0, e["ts"] + e["dur"] - t0, e["name"])
        step.spans.append(span)
        correlation = e.get("args", {}).get("correlation")
        if correlation is not None:  # (an event without one belongs to no launch)
            by_correlation[correlation] = span
    launches = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and e.get("args", {}).get("correlation") in by_correlation]
    hosts = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
             and (e["name"].startswith("commopt::") or e.get("cat") == "user_annotation")
             and not e["name"].startswith("ProfilerStep#")]
    for op in hosts:
        inside = [by_correlation[e["args"]["correlation"]] for e in launches
                  if e["tid"] == op["tid"] and op["ts"] <= e["ts"] <= op["ts"] + op["dur"]]
        if inside:
            name = op["name"].removeprefix("commopt::")
            schedule = _schedule(op)
            step.regions.append(Region(f"{name} {schedule}".strip(), min(s.start for s in inside),
                                       max(s.end for s in inside)))
    busy = merge_intervals([(s.start, s.end) for s in step.spans])
    edges = [0.0] + [x for a, b in busy for x in (a, b)] + [step.duration]
    step.gaps = [(a, b) for a, b in zip(edges[::2], edges[1::2]) if b - a >= min_gap_us]
    return step


def render(steps: list[Step], png: str | pathlib.Path | None = None,
           html_path: str | pathlib.Path | None = None) -> None:
    """Draw the steps (module docstring) into a PNG and/or an HTML page."""
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("the timeline picture needs matplotlib (pip install matplotlib)") from e
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    span_ms = max(s.duration for s in steps) / 1e3
    heights = [len(s.lanes) + 2 for s in steps]
    fig, axes = plt.subplots(len(steps), 1, figsize=(14, 1.2 + 0.55 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, step in zip(axes[:, 0], steps):
        _draw(ax, step, span_ms)
    axes[-1, 0].set_xlabel("ms from the step's start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#bbbbbb"))
    fig.legend(handles, [*COLORS, "idle (no lane busy)"], loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    if png is not None:
        fig.savefig(png, dpi=110)
    if html_path is not None:
        svg = io.StringIO()
        fig.savefig(svg, format="svg")
        pathlib.Path(html_path).write_text(_page(steps, svg.getvalue()))
    plt.close(fig)


def _draw(ax, step: Step, span_ms: float) -> None:
    lanes = step.lanes
    for a, b in step.gaps:
        ax.axvspan(a / 1e3, b / 1e3, color="#bbbbbb", alpha=0.5, lw=0)
    for row, lane in enumerate(lanes):
        for kind, color in COLORS.items():
            bars = [(s.start / 1e3, (s.end - s.start) / 1e3) for s in step.spans if s.lane == lane and s.kind == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), color=color, lw=0)
    top = len(lanes)
    for i, region in enumerate(sorted(step.regions, key=lambda r: r.start)):
        y = top + 0.1 + 0.45 * (i % 2)
        ax.broken_barh([(region.start / 1e3, (region.end - region.start) / 1e3)], (y, 0.35), color="#555555", lw=0)
        if (region.end - region.start) / 1e3 > span_ms / 60:
            ax.text(region.start / 1e3, y + 0.5, region.label, fontsize=6, va="bottom", clip_on=True)
    s = step.summary()
    ax.set_title(f"{step.label}: {s['step_ms']:.2f} ms; compute {s['compute_ms']:.2f}, copy {s['copy_ms']:.2f}, "
                 f"NCCL {s['nccl_ms']:.2f} ms busy; idle {s['idle_ms']:.2f} ms in {s['gaps']} gaps", fontsize=9,
                 loc="left")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.set_ylim(-0.6, top + 1.4)
    ax.set_xlim(0, span_ms)


def _page(steps: list[Step], svg: str) -> str:
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (
            s.label, *(f"{v:.3f}" if isinstance(v, float) else v for v in s.summary().values()), len(s.regions)))
        + "</tr>" for s in steps)
    head = "".join(f"<th>{h}</th>" for h in ("step", "step ms", "compute ms", "copy ms", "NCCL ms", "idle ms", "gaps",
                                             "regions"))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>torch_commopt timeline</title>"
            "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:right}</style></head><body>"
            "<h1>Where the step's time goes</h1><p>One lane per GPU stream; regions above them; idle gaps "
            f"shaded.</p><table><tr>{head}</tr>{rows}</table>{svg}</body></html>")
