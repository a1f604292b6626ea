"""Where the schedules' all-to-alls run: a side stream on CUDA, so their packing and unpacking
copies overlap the attention kernels instead of queueing between them.

A move is a function `fn(async_op)` (comm.exchange and its users): with async_op it starts the
transfer and returns a function that waits and gives the moved tensors; without, it returns
them.  `Lane.move` runs `fn(False)` on the device's high-priority side stream (after the
compute stream's work so far), records an event, and returns a waiter that makes the compute
stream wait for that event -- the CPU never blocks.  The caching allocator is told about the
cross-stream uses (record_stream): what the side stream reads, and what it hands back.

Off by default (TORCH_COMMOPT_ATTENTION_LANE=1, core/env.py, turns it on): it barely moved
ulysses and made ring_zigzag's pipelined relayouts slower, since the side stream's all-to-alls
sit between the ring's NCCL transfers
(docs/context-parallel-attention.md#what-was-tried-and-not-kept).  Without it a move runs as
`fn(True)`: packing on the compute stream, the collective in flight on its own.  Never inside a
CUDA-graph capture (a side stream there needs its own fork/join per capture) nor on a CPU
device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torch_commopt.core import env

Move = Callable[[bool], object]
ENV = env.ATTENTION_LANE
_SIDE: dict[int, "torch.cuda.Stream"] = {}


def device_stream(cache: dict, device: torch.device, priority: int = 0) -> "torch.cuda.Stream":
    """The stream `cache` keeps for `device` (made on first use with `priority`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        cache[index] = torch.cuda.Stream(device=index, priority=priority)
    return cache[index]


class Lane:
    """Runs moves off the compute stream where it can (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.side = None
        if device.type == "cuda" and env.attention_lane() \
                and not torch.cuda.is_current_stream_capturing():
            self.compute = torch.cuda.current_stream(device)
            self.side = device_stream(_SIDE, device, priority=-1)

    def move(self, fn: Move, reads: Sequence[Tensor]) -> Callable[[], list[Tensor]]:
        """Start fn; returns a function that (on the compute stream) waits and gives its result.
        reads: the tensors fn reads that the compute stream made or will reuse."""
        if self.side is None:
            return fn(True)
        self.side.wait_stream(self.compute)
        with torch.cuda.stream(self.side):
            for t in reads:
                t.record_stream(self.side)
            got = fn(False)
            done = self.side.record_event()

        def wait() -> list[Tensor]:
            self.compute.wait_event(done)
            for t in got:
                t.record_stream(self.compute)
            return got
        return wait
