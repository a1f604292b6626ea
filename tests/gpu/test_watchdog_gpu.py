"""GPU waits are bounded in production (kernels/gpu/watchdog.py): a peer that skips a call turns the
stuck wait -- a stream wait, a fused kernel's spin, a replayed graph's -- into a WaitTimeout naming
the op, schedule and peer within the bound; the GPU runs on; the group's later calls raise at once."""

from __future__ import annotations

import pytest
from watchdog_cases import BOUND_S, STUCK_CASES, run_stuck_peer

from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
def test_a_stuck_peer_becomes_a_wait_timeout_naming_it(two_ranks):
    world, backend = two_ranks
    per_rank = run_distributed(run_stuck_peer, world, backend=backend, timeout_s=300)
    assert per_rank[1] == []
    assert [r[0] for r in per_rank[0]] == [c[0] for c in STUCK_CASES]
    for (label, op, sched, _, what), (_, message, seconds, usable, later) in zip(STUCK_CASES, per_rank[0]):
        name = "ag_matmul" if op == "ag" else "matmul_rs"
        for part in (f"{name} ({sched})", f"for {what} from rank 1", "awaited >=", "results are garbage"):
            assert part in message, (label, part, message)
        if "replayed" in label:
            assert "a captured call" in message, message
        # the poll interval is BOUND_S / 20; the rest is the copy of the flags and the release
        assert BOUND_S <= seconds < BOUND_S + 3, (label, seconds)
        assert usable, label
        assert later == message, (label, later)  # the group is closed: the same error, at once


@pytest.mark.gpu
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_a_peer_that_skips_a_low_latency_call_is_reported_within_the_bound(two_ranks, debug):
    """The one-shot / two-shot all-reduce and the one-shot all-gather: the barrier spin that waits
    for the missing rank gives a WaitTimeout naming the call and the peer within the bound (the
    watchdog in production, the kernel's own bound in debug mode), and the GPU runs on."""
    from watchdog_cases import run_stuck_lowlat

    world, backend = two_ranks
    per_rank = run_distributed(run_stuck_lowlat, world, debug, backend=backend, timeout_s=300)
    assert per_rank[1] == []
    assert [r[0] for r in per_rank[0]] == ["one-shot all-reduce", "two-shot all-reduce", "one-shot all-gather"]
    for label, message, seconds, usable in per_rank[0]:
        assert label in message and "ll barrier from rank 1" in message, (label, message)
        assert BOUND_S <= seconds < BOUND_S + 3, (label, seconds)
        assert usable, label
