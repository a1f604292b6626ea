"""Where one training step's device time goes, by kernel category (bench_e2e, bench_plan).

`breakdown(step, sync)` profiles one call of `step` with torch.profiler (CUDA activity) and
returns ms per category, summed over kernels (overlapped kernels both count, so the sum can
exceed the step), plus gpu_span (first kernel start to last end) and gpu_busy (the union of
every kernel and copy interval over that span).  Every rank of a distributed step must run it
(the step's collectives), even where only one rank keeps the result.

`idle_gaps` names what the device waited between: each stretch of the step where no kernel or
copy ran, with the kernel that ended before it and the one that started after it.  In a
copy-engine schedule a peer's push into this rank runs on the peer's copy engine, so waiting for
it shows here as idle time before the kernel that reads the data.
"""

from __future__ import annotations

import time

import torch

from torch_commopt.timeline import merge_intervals, total_length

CATEGORIES = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
              # cuBLAS's axpy (a replayed call's partial added into the output: host_replay's
              # cublasAxpyEx) is an elementwise add, not a GEMM, though its name says cublas
              ("add (axpy)", ("axpy",)),
              ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
              ("commopt/triton", ("triton", "commopt")),
              # copy-engine transfers to a peer (commopt's pushes) apart from the device-local ones
              ("copy to peer", ("memcpy ptop",)), ("copy", ("memcpy", "memset", "copy")))


def category(kernel: str) -> str:
    """The category (CATEGORIES) of a kernel or copy by its name: the first whose keys it holds."""
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def breakdown(step, sync, label: str = "", steps: int = 1, lead: int = 0) -> dict[str, float]:
    """Device time of one step by kernel category (ms, summed over kernels; overlapped kernels
    both count, so the sum can exceed the step).  steps > 1: that many steps run back to back
    (one synchronize at the end) and every figure is per step (their sum over `steps`); the
    idle gaps are the whole run's.  lead > 0: that many unprofiled steps are queued right
    before the profiled ones, with no synchronize between, so these start with the GPU busy
    and at its sustained clocks, as inside a training loop (else they start from an idle GPU).
    "window": the (time.time()) start and end of the profiled steps, lead steps included.  With
    COMMOPT_TRACE_DIR set, one more step is profiled with its host ops (input shapes and strides
    recorded) and its Chrome trace written there, one file per rank (<label>_rank<r>.json), for the
    timelines the categories cannot show (which stream waited on what, what the host was doing); the
    profiled steps' own trace goes beside it (<label>_sustained_rank<r>.json)."""
    import json
    import os

    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.time()
    for _ in range(lead):
        step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
        window = (t0, time.time())
    trace_dir, causes = os.environ.get("COMMOPT_TRACE_DIR"), None
    if trace_dir:  # one more step, host ops (with their input shapes and strides) and device, for the trace only
        import re

        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(trace_dir, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9]+", "_", label) or "step"
        # the profiled steps themselves (device and launch calls only): the sustained timeline
        # whose idle gaps the figures below count, where the traced step below starts from an idle GPU
        sustained = os.path.join(trace_dir, f"{name}_sustained_rank{rank}.json")
        prof.export_chrome_trace(sustained)
        with open(sustained) as f:
            causes = gap_causes(json.load(f))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as traced:
            step()
            sync()
        traced.export_chrome_trace(os.path.join(trace_dir, f"{name}_rank{rank}.json"))
    totals: dict = {}
    # GPU idle: the union of every kernel / copy interval of the step against its span
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    spans = merge_intervals([(lo, hi) for _, lo, hi in events])
    if spans:
        totals["gpu_span"] = (spans[-1][1] - spans[0][0]) / 1e3
        totals["gpu_busy"] = total_length(spans) / 1e3
        totals["local copy alone"] = copies_alone(events) / 1e3
    kernels: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        ms = getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) / 1e3
        if ms <= 0:
            continue
        cat = category(evt.key)
        totals[cat] = totals.get(cat, 0.0) + ms
        acc = kernels.setdefault(_short(evt.key, KERNEL_NAME), [0.0, 0])
        acc[0], acc[1] = acc[0] + ms, acc[1] + evt.count
    out = {k: round(v / steps, 3) for k, v in sorted(totals.items())}
    out["kernels"] = {k: [round(ms / steps, 3), n / steps] for k, (ms, n) in
                      sorted(kernels.items(), key=lambda kv: -kv[1][0])[:KERNELS_KEPT]}
    out["idle_gaps"] = idle_gaps(events)
    if causes is not None:
        out["idle_gaps"]["causes"] = causes
    out["window"] = window
    return out


def copies_alone(events: list[tuple[str, float, float]]) -> float:
    """Time (us) in which a device-local copy (Memcpy DtoD / HtoD / DtoH, Memset) ran and no kernel
    did: such a copy holds back every kernel queued behind it, so this is device time the copies
    cost the step outright (a copy to a peer runs on the copy engines beside kernels: not counted)."""
    def is_copy(name: str) -> bool:
        low = name.lower()
        return ("memcpy" in low or "memset" in low) and "ptop" not in low

    copies = [(lo, hi) for name, lo, hi in events if is_copy(name)]
    kernels = [(lo, hi) for name, lo, hi in events if not is_copy(name) and "ptop" not in name.lower()]
    # what the copies add to the kernels' union is the time they ran alone
    return total_length(merge_intervals(copies + kernels)) - total_length(merge_intervals(kernels))


KERNELS_KEPT = 60  # the kernels (by name) a breakdown keeps, longest first
KERNEL_NAME = 56  # characters of a kernel's name kept


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def idle_gaps(events: list[tuple[str, float, float]], min_us: float = 5.0, top: int = 10) -> dict:
    """Where the device sat idle: `events` are (name, start_us, end_us) of every kernel and copy.
    Returns the idle total over gaps of at least `min_us`, the largest gaps (offset from the first
    event, length, the kernel before and the one after; in us) and the gaps summed by their
    (before, after) pair, largest first (ms)."""
    events = sorted(events, key=lambda e: (e[1], e[2]))
    gaps, last_end, last_name = [], None, None
    for name, lo, hi in events:
        if last_end is not None and lo - last_end >= min_us:
            gaps.append((lo - last_end, last_end, last_name, name))
        if last_end is None or hi > last_end:
            last_end, last_name = hi, name
    t0 = events[0][1] if events else 0.0
    pairs: dict[tuple[str, str], list[float]] = {}
    for length, _at, before, after in gaps:
        acc = pairs.setdefault((_short(before), _short(after)), [0.0, 0])
        acc[0] += length
        acc[1] += 1
    largest = sorted(gaps, reverse=True)[:top]
    return {"idle_ms": round(sum(g[0] for g in gaps) / 1e3, 3), "gaps": len(gaps), "min_us": min_us,
            "largest": [{"at_ms": round((at - t0) / 1e3, 3), "us": round(length, 1), "before": _short(before),
                         "after": _short(after)} for length, at, before, after in largest],
            "by_pair": [{"before": b, "after": a, "ms": round(v[0] / 1e3, 3), "count": v[1]}
                        for (b, a), v in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]]}


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def gap_causes(trace: dict, min_us: float = 5.0) -> dict:
    """Why the device sat idle, from a profiled step's Chrome trace (its device operations and the
    host calls that queued them, matched by correlation id): a gap of at least `min_us` is the
    host's ("host_late") where the call queuing the operation after it returned after the device
    went idle, else a dependency's ("queued"): that operation was already queued and waited on
    another stream, a peer's flag or copy, or an event.  ("unmatched": no queuing call in the
    trace.)  {cause: {"ms", "count"}}."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE_CATS),
                    key=lambda e: (e["ts"], e["ts"] + e["dur"]))
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    out = {c: {"ms": 0.0, "count": 0} for c in ("host_late", "queued", "unmatched")}
    idle_from = None
    for e in device:
        if idle_from is not None and e["ts"] - idle_from >= min_us:
            call = launches.get(e.get("args", {}).get("correlation"))
            cause = "unmatched" if call is None else "host_late" if call["ts"] + call["dur"] > idle_from else "queued"
            out[cause]["ms"] += (e["ts"] - idle_from) / 1e3
            out[cause]["count"] += 1
        idle_from = max(idle_from, e["ts"] + e["dur"]) if idle_from is not None else e["ts"] + e["dur"]
    return {c: {"ms": round(v["ms"], 3), "count": v["count"]} for c, v in out.items()}


def split(breakdown_ms: dict | None) -> tuple[dict, dict | None]:
    """The category totals and the idle-gap summary of one `breakdown` (either may be absent;
    its wall-clock window and its kernels are left out)."""
    b = dict(breakdown_ms or {})
    b.pop("window", None)
    b.pop("kernels", None)
    return b, b.pop("idle_gaps", None)


def kernel_differences(label: str, mine: dict | None, other_label: str, other: dict | None, top: int = 8) -> list[str]:
    """Markdown lines: the `top` kernels (by name) whose time per step differs most between two
    breakdowns' `kernels` ({name: [ms, launches] per step}), with both sides' figures; [] when
    either has none.  What a category total hides: one kernel of the same name running twice as
    long (a layout the program changed), one that only one side runs."""
    if not mine or not other:
        return []
    names = set(mine) | set(other)
    diffs = sorted(names, key=lambda n: -abs(mine.get(n, [0.0, 0])[0] - other.get(n, [0.0, 0])[0]))[:top]
    lines = [f"- {label} against {other_label} (ms per step, launches per step):"]
    for n in diffs:
        (a, na), (b, nb) = mine.get(n, [0.0, 0]), other.get(n, [0.0, 0])
        lines.append(f"  - {a - b:+.3f} ms: {n} ({a:.3f} ms x{na:g} against {b:.3f} ms x{nb:g})")
    return lines


def format_idle(label: str, idle: dict | None) -> list[str]:
    """Markdown lines for one idle-gap summary."""
    if not idle:
        return []
    lines = [f"- {label}: idle {idle['idle_ms']} ms in {idle['gaps']} gaps of >= {idle['min_us']:g} us; by "
             "(before -> after): " + "; ".join(f"{p['before']} -> {p['after']} {p['ms']} ms x{p['count']}"
                                               for p in idle["by_pair"][:6])]
    causes = idle.get("causes")
    if causes:
        lines.append("  - why (from the trace's queuing calls): " + "; ".join(
            f"{what}: {causes[c]['ms']} ms in {causes[c]['count']}" for c, what in _CAUSE_WORDS if causes[c]["count"]))
    lines += [f"  - at {g['at_ms']} ms: {g['us']} us, {g['before']} -> {g['after']}" for g in idle["largest"][:5]]
    return lines


_CAUSE_WORDS = (("host_late", "the host queued the next operation after the device went idle"),
                ("queued", "the next operation was queued and waited on a dependency (another stream, a peer, "
                           "an event)"),
                ("unmatched", "no queuing call found"))
