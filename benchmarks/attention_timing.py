"""Timing of the attention benchmarks (bench_attention, bench_flex): calls back to back, sized per
sample, after untimed lead calls, the slowest rank's ms per call in rotated rounds."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class Clock:
    """CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, dev: str):
        self.cuda = dev == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, step, count: int, lead: int = 0) -> float:
        """ms per call of `count` back-to-back calls, after `lead` untimed calls queued just
        before them (no synchronize between: the timed window opens on a busy device)."""
        self.sync()
        for _ in range(lead):
            step()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(count):
                step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / count
        t0 = time.perf_counter()
        for _ in range(count):
            step()
        return (time.perf_counter() - t0) * 1e3 / count


# A sample's calls run back to back after a barrier and a synchronize, sized from the fastest of
# SIZING_CALLS single calls after WARMUP_CALLS untimed ones, so that one slow first-use call
# cannot shrink them.  LEAD_CALLS untimed calls are queued right before a sample's timed ones (no
# synchronize between), for every variant alike, so the timed window opens on a busy device with
# the host ahead of it and the ranks already coupled by the lead's own transfers -- as an
# attention call finds them inside a training step, where the layer's projections are still
# running when the host queues it.  Without a lead (--lead 0) the window opens on an idle device
# right after a barrier: the first call then carries the ranks' exit skew and its host's enqueue
# ahead of its first kernel, which no training step pays (on 2x H200 at 16K the first call of a
# sample read 0.9-1.0 ms slower than the ones after it; torch CP gains about as much from the
# lead as commopt does).  20 ms samples read within the run-to-run spread of 100 ms ones.
TARGET_MS, WARMUP_CALLS, SIZING_CALLS, LEAD_CALLS = 20.0, 2, 3, 1


def sample_calls(step, clock: "Clock", target_ms: float) -> int:
    """Calls per timed sample on this rank: after WARMUP_CALLS untimed calls (kernel selection,
    allocator, buffers), enough to last target_ms at the fastest of SIZING_CALLS single calls."""
    for _ in range(WARMUP_CALLS):
        step()
    ms = min(clock.time_ms(step, 1) for _ in range(SIZING_CALLS))
    return max(1, min(200, int(target_ms / max(ms, 1e-3)) + 1))


def _calls_per_sample(step, clock: "Clock", target_ms: float, dev: str) -> int:
    """sample_calls, every rank the same (the largest)."""
    n = torch.tensor([sample_calls(step, clock, target_ms)], device=dev, dtype=torch.float64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n.item())


def time_variants(variants: dict, clock: Clock, dev: str, repeats: int, target_ms: float,
                  lead: int = 0) -> dict[str, list[float]]:
    """{name: [ms per call in each round, slowest rank]}.  A variant is a zero-argument
    callable returning a fresh context manager that yields (step, outputs); torch CP's
    contexts are entered once per sample, outside the timed window; lead: untimed calls queued
    before each sample's timed ones (Clock.time_ms)."""
    names = list(variants)
    counts = {}
    for name in names:
        with variants[name]() as (step, _):
            counts[name] = _calls_per_sample(step, clock, target_ms, dev)
    samples = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            with variants[name]() as (step, _):
                dist.barrier()
                samples[name].append(clock.time_ms(step, counts[name], lead))
    t = torch.tensor([samples[n] for n in names], device=dev, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(names, t.tolist()))
