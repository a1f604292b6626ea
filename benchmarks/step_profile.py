"""Where one training step's device time goes, by kernel category (bench_e2e, bench_plan).

`breakdown(step, sync)` profiles one call of `step` with torch.profiler (CUDA activity) and
returns ms per category, summed over kernels (overlapped kernels both count, so the sum can
exceed the step), plus gpu_span (first kernel start to last end) and gpu_busy (the union of
every kernel and copy interval over that span).  Every rank of a distributed step must run it
(the step's collectives), even where only one rank keeps the result.
"""

from __future__ import annotations

import torch

CATEGORIES = (("nccl", ("nccl",)), ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
              ("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_")),
              ("commopt/triton", ("triton", "commopt")), ("copy", ("memcpy", "memset", "copy")))


def breakdown(step, sync) -> dict[str, float]:
    """Device time of one step by kernel category (ms, summed over kernels; overlapped kernels
    both count, so the sum can exceed the step)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    totals: dict[str, float] = {}
    # GPU idle: the union of every kernel / copy interval of the step against its span
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, last = 0.0, None
    for lo, hi in spans:
        if last is None or lo > last:
            busy, last = busy + hi - lo, hi
        elif hi > last:
            busy, last = busy + hi - last, hi
    if spans:
        totals["gpu_span"] = (max(hi for _, hi in spans) - spans[0][0]) / 1e3
        totals["gpu_busy"] = busy / 1e3
    for evt in prof.key_averages():
        ms = getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0.0)) / 1e3
        if ms <= 0:
            continue
        name = evt.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")
        totals[cat] = totals.get(cat, 0.0) + ms
    return {k: round(v, 3) for k, v in sorted(totals.items())}
