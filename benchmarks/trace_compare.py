"""Which kernels of one step got slower, and what ran beside them (Chrome traces, CPU only).

bench_e2e with COMMOPT_TRACE_DIR set writes one traced step per variant and rank
(step_profile.breakdown).  Given two of them, this prints per kernel category and per kernel
name (the same name in both steps is the same work) the count and device time in each, and for
every kernel the share of its time that ran while a copy (copy engine: to a peer or local) or a
kernel on another stream was running on the same device.  A kernel that takes longer in one
step only while copies run beside it is slowed by them (memory traffic, power), not by its own
shape.  With the host ops in the trace (bench_e2e records their input shapes), each GEMM
kernel is also tied to the aten matmul that launched it, so the GEMMs are listed by shape with
their achieved TFLOP/s: a schedule's pieces against the whole GEMMs they replace.

    python3 benchmarks/trace_compare.py BASE.json OTHER.json [--top 25] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from step_profile import CATEGORIES  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MATMULS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::addmm_": (1, 2), "aten::_scaled_mm": (0, 1)}


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def trace_events(path: str) -> list[dict]:
    """Every event of a Chrome trace file (a {"traceEvents": [...]} document or a bare list)."""
    doc = json.loads(pathlib.Path(path).read_text())
    return doc if isinstance(doc, list) else doc.get("traceEvents", [])


def device_events(events: list[dict]) -> list[dict]:
    """The trace's device events: {name, cat, start, end (us), stream, copy}."""
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS or not e.get("dur"):
            continue
        args = e.get("args", {})
        out.append({"name": e["name"], "start": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                    "stream": args.get("stream", e.get("tid")), "copy": e["cat"] != "kernel"})
    return sorted(out, key=lambda e: e["start"])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _covered(lo: float, hi: float, union: list[tuple[float, float]], starts: list[float]) -> float:
    """How much of [lo, hi] the (sorted, disjoint) intervals cover."""
    i, got = max(0, bisect.bisect_right(starts, lo) - 1), 0.0
    while i < len(union) and union[i][0] < hi:
        got += max(0.0, min(hi, union[i][1]) - max(lo, union[i][0]))
        i += 1
    return got


def beside(events: list[dict]) -> list[dict]:
    """Each kernel with `with_copy` / `with_kernel`: its time while a copy ran, or a kernel on
    another stream ran (us)."""
    copies = _union([(e["start"], e["end"]) for e in events if e["copy"]])
    copy_starts = [lo for lo, _ in copies]
    by_stream = collections.defaultdict(list)
    for e in events:
        if not e["copy"]:
            by_stream[e["stream"]].append((e["start"], e["end"]))
    others = {}
    for s in by_stream:
        u = _union([iv for t, ivs in by_stream.items() if t != s for iv in ivs])
        others[s] = (u, [lo for lo, _ in u])
    out = []
    for e in events:
        if e["copy"]:
            continue
        u, starts = others[e["stream"]]
        out.append(dict(e, with_copy=_covered(e["start"], e["end"], copies, copy_starts),
                        with_kernel=_covered(e["start"], e["end"], u, starts)))
    return out


def gemm_shapes(events: list[dict]) -> dict[str, dict]:
    """{"op MxKxN": {n, ms, tflops}}: each GEMM kernel by the aten matmul whose launch it came
    from (correlation id -> the launching runtime / driver call -> the innermost matmul op
    around it on that host thread); {} without host ops in the trace."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("name") in MATMULS and e.get("dur"):
            ops[e.get("tid")].append(e)
    out: dict[str, dict] = {}
    for k in events:
        if k.get("cat") != "kernel" or category(k.get("name", "")) != "gemm":
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        around = [e for e in ops.get(launch.get("tid"), []) if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]] if launch else []
        dims = around[-1]["args"].get("Input Dims") if around else None
        if not dims:
            continue
        i, j = MATMULS[around[-1]["name"]]
        (m, kk), n = dims[i][-2:], dims[j][-1]
        r = out.setdefault(f"{around[-1]['name'].removeprefix('aten::')} {m}x{kk}x{n}", {"n": 0, "ms": 0.0, "flop": 0.0})
        r["n"] += 1
        r["ms"] += float(k["dur"]) / 1e3
        r["flop"] += 2.0 * m * kk * n
    for r in out.values():
        r["tflops"] = r.pop("flop") / (r["ms"] / 1e3) / 1e12 if r["ms"] else 0.0
    return out


def summarize(path: str) -> dict:
    """{"categories": {cat: ms}, "kernels": {name: {n, ms, with_copy_ms, with_kernel_ms}}, "span_ms",
    "gemms": gemm_shapes} of one trace file (read once)."""
    everything = trace_events(path)
    events = device_events(everything)
    kernels = beside(events)
    per_name: dict[str, dict] = {}
    cats: dict[str, float] = collections.Counter()
    for k in kernels:
        r = per_name.setdefault(k["name"], {"n": 0, "ms": 0.0, "with_copy_ms": 0.0, "with_kernel_ms": 0.0})
        r["n"] += 1
        r["ms"] += (k["end"] - k["start"]) / 1e3
        r["with_copy_ms"] += k["with_copy"] / 1e3
        r["with_kernel_ms"] += k["with_kernel"] / 1e3
        cats[category(k["name"])] += (k["end"] - k["start"]) / 1e3
    for e in events:
        if e["copy"]:
            cats[category(e["name"])] += (e["end"] - e["start"]) / 1e3
    span = (max(e["end"] for e in events) - events[0]["start"]) / 1e3 if events else 0.0
    return {"categories": dict(cats), "kernels": per_name, "span_ms": span, "gemms": gemm_shapes(everything)}


def compare(base: dict, other: dict, top: int = 25) -> list[str]:
    lines = [f"span: {base['span_ms']:.2f} ms -> {other['span_ms']:.2f} ms", "", "| category | base ms | other ms | diff |",
             "|---|---|---|---|"]
    for cat in sorted(set(base["categories"]) | set(other["categories"])):
        b, o = base["categories"].get(cat, 0.0), other["categories"].get(cat, 0.0)
        lines.append(f"| {cat} | {b:.3f} | {o:.3f} | {o - b:+.3f} |")
    lines += ["", "Kernels by name in both steps, largest time difference first (mean per call; the share of "
              "their time beside a copy / beside a kernel on another stream):", "",
              "| kernel | cat | n base/other | base mean us (copy, kernel) | other mean us (copy, kernel) | diff ms |",
              "|---|---|---|---|---|---|"]
    both = [n for n in base["kernels"] if n in other["kernels"]]
    both.sort(key=lambda n: -abs(other["kernels"][n]["ms"] - base["kernels"][n]["ms"]))
    for name in both[:top]:
        b, o = base["kernels"][name], other["kernels"][name]

        def cell(r):
            return (f"{r['ms'] / r['n'] * 1e3:.1f} ({r['with_copy_ms'] / r['ms']:.0%}, "
                    f"{r['with_kernel_ms'] / r['ms']:.0%})")
        short = name if len(name) <= 60 else name[:57] + "..."
        lines.append(f"| {short} | {category(name)} | {b['n']}/{o['n']} | {cell(b)} | {cell(o)} | "
                     f"{o['ms'] - b['ms']:+.3f} |")
    for label, side in (("base", base), ("other", other)):
        if side.get("gemms"):
            lines += ["", f"GEMMs by the matmul that launched them ({label}; a kernel beside another counts its whole "
                      "time, so pieces run concurrently show a lower rate):", "", "| matmul (M x K x N) | n | ms | TFLOP/s |",
                      "|---|---|---|---|"]
            lines += [f"| {k} | {r['n']} | {r['ms']:.3f} | {r['tflops']:.0f} |"
                      for k, r in sorted(side["gemms"].items(), key=lambda kv: -kv[1]["ms"])[:top]]
    only = sorted((n for n in other["kernels"] if n not in base["kernels"]), key=lambda n: -other["kernels"][n]["ms"])
    lines += ["", "Only in the other step (ms):", ""]
    lines += [f"- {n[:80]} ({category(n)}): {other['kernels'][n]['n']} calls, {other['kernels'][n]['ms']:.3f} ms"
              for n in only[:top]]
    gone = sorted((n for n in base["kernels"] if n not in other["kernels"]), key=lambda n: -base["kernels"][n]["ms"])
    lines += ["", "Only in the base step (ms):", ""]
    lines += [f"- {n[:80]} ({category(n)}): {base['kernels'][n]['n']} calls, {base['kernels'][n]['ms']:.3f} ms"
              for n in gone[:top]]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default="")
    args = p.parse_args()
    base, other = summarize(args.base), summarize(args.other)
    print("\n".join(compare(base, other, args.top)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"base": base, "other": other}, indent=1))


if __name__ == "__main__":
    main()
