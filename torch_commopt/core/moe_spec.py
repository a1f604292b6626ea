"""The expert-parallel schedules' names (kernels/moe/schedules.py runs them; Config checks them).

A leaf module: imports nothing from torch_commopt."""

from __future__ import annotations

# a2a: torchtitan's exchange (one all-to-all each way, nothing overlapped); by_peer: one ring step
# per peer, the experts on each source's rows as they arrive; by_expert[:C]: the exchange in C
# chunks of experts (default 2), each chunk's experts running as it arrives and its outputs going
# home while later chunks compute; sync_free: every size on the device, no host read of the counts,
# fixed shapes (equal blocks of a capacity); auto: the tuner's pick among a2a and by_expert (docs/moe.md)
MOE_SCHEDULES = ("a2a", "by_peer", "by_expert", "sync_free", "auto")


def parse_moe_schedule(schedule: str) -> tuple[str, int | None]:
    """(name, chunks) of a schedule string: "a2a", "by_peer", "by_expert" or "by_expert:C" (C >= 1
    chunks of experts).  ValueError naming what is wrong."""
    if not isinstance(schedule, str):
        raise ValueError(f"expert-parallel schedule must be a string, got {schedule!r}")
    name, sep, arg = schedule.partition(":")
    if name not in MOE_SCHEDULES:
        raise ValueError(f"unknown expert-parallel schedule {schedule!r} (known: {', '.join(MOE_SCHEDULES)}, by_expert:C)")
    if not sep:
        return name, None
    if name != "by_expert" or not arg.isdigit() or int(arg) < 1:
        raise ValueError(f"malformed expert-parallel schedule {schedule!r}: only by_expert takes ':C', C >= 1 chunks")
    return name, int(arg)
