"""Workers for the rank-agreement tests (importable by spawned processes): faults injected on
live gloo groups -- a late rank, a recompile on one rank only, a dead peer, a dead store."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt
from torch_commopt.core import consistency
from torch_commopt.tuner.decide import DecisionMismatch, decide

TIMEOUT_S = 3.0  # the agreement's bound in these tests: well above the ranks' compile skew on CPU


def _program(a, b):
    return funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD.group_name) @ b


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(6, 8, generator=gen), torch.randn(8, 4, generator=torch.Generator().manual_seed(9))


def _graphs():
    return [{"rewritten": len(g.rewritten), "collectives_after": g.collectives_after, "notes": g.notes}
            for g in torch_commopt.explain().graphs]


def _checked_call(fn, rank: int) -> float:
    """fn on this rank's inputs; its largest difference from eager."""
    a, b = _inputs(rank)
    return float((fn(a, b) - _program(a, b)).abs().max())


def forced_mismatch(rank: int, world: int):
    """Rank 1 computes a different plan hash: no rank may rewrite, and results stay right."""
    if rank == 1:
        consistency.plan_hash = lambda decisions: "forced-different"
    torch_commopt.reset_explain()
    compiled = torch.compile(_program, backend="commopt", options={"consistency_timeout_s": TIMEOUT_S})
    return {"max_abs_diff": _checked_call(compiled, rank), "graphs": _graphs()}


def late_rank(rank: int, world: int):
    """The last rank reaches the plan check after the others gave up on it: it must follow their
    outcome (the original collectives), not find every vote published and rewrite alone."""
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 3.0)
    torch_commopt.reset_explain()
    compiled = torch.compile(_program, backend="commopt", options={"consistency_timeout_s": TIMEOUT_S})
    start = time.monotonic()
    diff = _checked_call(compiled, rank)
    return {"max_abs_diff": diff, "graphs": _graphs(), "seconds": time.monotonic() - start}


def recompile_on_one_rank(rank: int, world: int):
    """Every rank compiles and rewrites; then rank 1 alone compiles the same graph again (as a
    guard failing on it alone would make it): it must rewrite the same way, at once, while the
    other ranks keep running their compiled graph."""
    torch_commopt.reset_explain()
    compiled = torch.compile(_program, backend="commopt", options={"consistency_timeout_s": TIMEOUT_S})
    first = _checked_call(compiled, rank)
    if rank == 1:
        torch._dynamo.reset()
    start = time.monotonic()
    second = _checked_call(compiled, rank)
    return {"max_abs_diff": max(first, second), "graphs": _graphs(), "seconds": time.monotonic() - start}


def dead_peer(rank: int, world: int):
    """The last rank never votes: the others are told within the timeout, naming it."""
    if rank == world - 1:
        return None
    decision = consistency.Decision("plan", dist.group.WORLD.group_name, "dead-peer", "plan of graph 7 (forward)")
    start = time.monotonic()
    outcome = consistency.agree(decision, "value", TIMEOUT_S)
    return outcome, time.monotonic() - start


def late_voter_learns(rank: int, world: int):
    """Rank 0 gives up on a decision; rank 1 votes afterwards and must read that outcome at once."""
    decision = consistency.Decision("plan", dist.group.WORLD.group_name, "late-voter", "plan of graph 1 (forward)")
    if rank == 1:
        time.sleep(TIMEOUT_S + 1.0)
    start = time.monotonic()
    outcome = consistency.agree(decision, "same", TIMEOUT_S)
    return outcome, time.monotonic() - start


def values_differ(rank: int, world: int):
    decision = consistency.Decision("plan", dist.group.WORLD.group_name, "differ", "plan of graph 2 (backward)")
    return consistency.agree(decision, f"value-{rank % 2}", 60.0)


def decided_once(rank: int, world: int):
    """The same identity decided twice: the second time every rank follows the first outcome
    without waiting, even a rank that asks alone."""
    decision = consistency.Decision("plan", dist.group.WORLD.group_name, "twice", "plan of graph 3 (forward)")
    first = consistency.agree(decision, "v", TIMEOUT_S)
    dist.barrier()
    start = time.monotonic()
    again = consistency.agree(decision, "v", TIMEOUT_S) if rank == world - 1 else None
    return first, again, time.monotonic() - start


def tuning(rank: int, world: int, case: str):
    """decide() with faults: 'slow_leader' (rank 0 answers after the others gave up: every rank
    gets DecisionMismatch), 'failing_leader' (rank 0's answer raises: the others are told at
    once), 'asked_again' (rank 1 asks an answered question again alone: the same answer)."""
    group = dist.group.WORLD.group_name

    def answer():
        if case == "slow_leader":
            time.sleep(TIMEOUT_S + 2.0)
        if case == "failing_leader":
            raise OSError("cache unreadable")
        return {"schedule": "chunked:2"}

    start = time.monotonic()
    try:
        result = decide(group, {"question": case}, answer, TIMEOUT_S)
    except DecisionMismatch as e:
        result = f"mismatch: {e}"
    except OSError as e:
        result = f"raised: {e}"
    if case == "asked_again":
        dist.barrier()
        again = decide(group, {"question": case}, lambda: {"schedule": f"rank {rank}'s own"}, TIMEOUT_S) \
            if rank == 1 else result
        return result, again, time.monotonic() - start
    return result, None, time.monotonic() - start


class _BrokenStore:
    """A c10d store whose server is gone (every call raises, as a broken pipe does)."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Broken pipe")
        return fail


def store_unreachable(rank: int, world: int):
    """agree with the store gone: an answer (not agreed), never an exception, and fast."""
    dist.distributed_c10d._get_default_store = lambda: _BrokenStore()
    decision = consistency.Decision("plan", dist.group.WORLD.group_name, "no-store", "plan of graph 4 (forward)")
    start = time.monotonic()
    outcome = consistency.agree(decision, "x", 60.0)
    return outcome, time.monotonic() - start
