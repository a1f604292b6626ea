"""Device time of a callable: the median of batches of back-to-back calls."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

BATCH_S = 5e-3  # device time per timing sample
SLEEP_CYCLES_PER_S = 3e9  # more than a GPU's clock: a sleep of t * this outlasts t seconds
SLEEP_CYCLES_PER_CALL = 100_000  # ~50 us of a ~2 GHz GPU per queued call: more than enqueueing one costs


def device_time(fn, device: torch.device, reps: int, group=None, preroll: bool = False) -> float:
    """Median seconds per call of `fn`, device time.  On a GPU each sample is a batch of
    back-to-back calls (>= BATCH_S of them) enqueued behind a sleep kernel, so the host's
    launch cost is not in the figure (the model adds host time separately); on a CPU, wall
    time of single calls.  `fn` issuing a collective of `group`: the batch size is agreed
    over the group (every rank must issue the same number of collectives).  preroll=True:
    another batch of `fn` runs untimed between the sleep and the timed batch, so the timed
    one runs at the clocks of a GPU kept busy (a program's back-to-back GEMMs) rather than
    those of one that just idled in the sleep (a fit from samples timed right after the
    sleep predicts long TP GEMMs 15-20% faster than they run back to back; the preroll is
    meant to close that gap, not yet measured)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    single = time.perf_counter() - t0  # host + device of one call: the sleep must outlast n enqueues
    n = int(min(200, max(1, BATCH_S // max(single, 1e-6))))
    if group is not None:
        agreed = torch.tensor([n], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        n = int(agreed.item())
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        calls = 2 * n if preroll else n
        # keeps the GPU busy while the batch is enqueued
        torch.cuda._sleep(int(calls * max(SLEEP_CYCLES_PER_CALL, single * SLEEP_CYCLES_PER_S)))
        for _ in range(calls - n):
            fn()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(samples)
