"""The expert-parallel schedules' names (kernels/moe/schedules.py runs them; Config checks them).

A leaf module: imports nothing from torch_commopt."""

from __future__ import annotations

# a2a: torchtitan's exchange (one all-to-all each way, nothing overlapped); by_peer: one ring step
# per peer, the experts on each source's rows as they arrive (docs/moe.md)
MOE_SCHEDULES = ("a2a", "by_peer")
