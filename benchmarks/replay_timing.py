"""Time one call replayed from a CUDA graph, without the host: the probes' shared timer."""

from __future__ import annotations

import statistics
from typing import Callable, Optional

import torch


def replayed_ms_per_call(call: Callable[[], None], *, calls: int, replays: int, warmups: int = 1,
                         check: Optional[Callable[[], None]] = None) -> float:
    """Median ms per call over `replays` replays of one CUDA graph holding `calls` back-to-back
    calls.  The warm-up calls run on a side stream outside the capture (cuBLAS picks its
    kernels there, as torch.cuda.graphs asks); `check()` runs after the first replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    if check is not None:
        check()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)
