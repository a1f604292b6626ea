"""Cross-rank agreement: every rank of a group makes the same choice, or every rank falls back.

A rank that rewrites a region another rank leaves alone, adopts another tuning answer, or uses a
symmetric buffer a peer could not allocate issues different collectives and deadlocks or corrupts
the group.  Every such decision is taken in two phases over the default c10d store, keyed by the
decision's *identity* (a digest of what is decided: the graph's collectives and plan, the tuning
question, the allocation), never by how many decisions a rank has taken so far:

1. vote: each rank publishes its value under ``<prefix>/vote/<rank>``;
2. outcome: once every vote is in, or the time is up, a rank proposes the outcome -- ``commit``
   when every value is equal, else ``abort`` -- with an atomic compare-and-set on
   ``<prefix>/outcome``.  The first proposal stands; every rank then follows the stored outcome.

So a rank that arrives after the others gave up reads ``abort`` and falls back with them; a rank
that compiles a graph again on its own (a guard that failed on it alone) finds the outcome of the
same identity and follows it without waiting; a dead or stuck peer costs `timeout_s` once per
decision, with a message naming the missing ranks, the group and the decision.  The store is
polled rather than waited on in one call so that a decided outcome ends the wait early and a
store failure (its host died) is told apart from a timeout.

`lead` is the one-answerer form (tuning): the group's first rank computes the answer and proposes
it; the others adopt the stored outcome, or propose ``abort`` when it does not come in time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from torch_commopt.core.groups import resolve_group

log = logging.getLogger("torch_commopt.core.consistency")

_COMMIT, _ABORT = "commit:", "abort:"
_POLL_S = (0.002, 0.05)  # first and steady polling interval: most decisions settle within milliseconds


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_hash(decisions: list[dict]) -> str:
    """Hash of the rewrite decisions (region summaries + schedules) of one graph."""
    return digest(decisions)


def check_skipped_reason() -> str | None:
    """Why no cross-rank check can run in this process, or None if it can."""
    if not dist.is_available() or not dist.is_initialized():
        return "no default process group"
    if dist.get_backend() == "fake":
        return "fake process group (single-process tracing)"
    return None


@dataclass(frozen=True)
class Decision:
    """What the ranks of `group_name` decide together.  identity: the same string on every rank
    that decides the same thing (a digest of it); what: how messages name it ("plan of graph 3
    (forward)", "tuning of all_gather_1")."""

    topic: str
    group_name: str
    identity: str
    what: str

    @property
    def prefix(self) -> str:
        return f"commopt/agree/{self.topic}/{self.group_name}/{self.identity}"


@dataclass(frozen=True)
class Outcome:
    """agreed: every rank follows `value`; otherwise every rank falls back.  detail: why."""

    agreed: bool
    value: str | None
    detail: str


class StoreFailure(RuntimeError):
    """The c10d store could not be reached (its host died, or the network failed)."""


def agree(decision: Decision, value: str, timeout_s: float) -> Outcome:
    """Vote `value`; the outcome every rank of the group follows (bounded by `timeout_s`)."""
    ranks, me = _ranks(decision.group_name)
    try:
        store = dist.distributed_c10d._get_default_store()
        stored = _outcome(store, decision)
        if stored is None:
            store.set(f"{decision.prefix}/vote/{me}", value)
            stored = _settle(store, decision, ranks, timeout_s)
    except StoreFailure as e:
        return _store_failed(decision, e)
    return _follow(decision, stored, value)


def lead(decision: Decision, answer: Callable[[], str], timeout_s: float) -> Outcome:
    """The group's first rank runs `answer()` and proposes it; every rank returns the stored
    outcome (the first rank's answer, or ``abort`` when a follower stopped waiting first)."""
    ranks, me = _ranks(decision.group_name)
    try:
        store = dist.distributed_c10d._get_default_store()
        stored = _outcome(store, decision)
        if stored is None and me == ranks[0]:
            try:
                proposal = _COMMIT + answer()
            except Exception as e:  # the followers must not wait out their timeout for it
                _propose(store, decision, f"{_ABORT}rank {me} could not answer ({type(e).__name__}: {e})")
                raise
            stored = _propose(store, decision, proposal)
        elif stored is None:
            stored = _await_outcome(store, decision, timeout_s)
            if stored is None:
                stored = _propose(store, decision, f"{_ABORT}rank {ranks[0]} gave no answer within {timeout_s:g} s")
    except StoreFailure as e:
        return _store_failed(decision, e)
    if stored.startswith(_COMMIT):
        return Outcome(True, stored[len(_COMMIT):], "rank 0's answer")
    return Outcome(False, None, _message(decision, stored[len(_ABORT):]))


def _ranks(group_name: str) -> tuple[list[int], int]:
    return dist.get_process_group_ranks(resolve_group(group_name)), dist.get_rank()


def _call(fn, *args):
    """A store call; any failure of the store itself becomes StoreFailure."""
    try:
        return fn(*args)
    except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError: the store is gone
        raise StoreFailure(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _outcome(store, decision: Decision) -> str | None:
    key = f"{decision.prefix}/outcome"
    return _call(store.get, key).decode() if _call(store.check, [key]) else None


def _propose(store, decision: Decision, proposal: str) -> str:
    """Compare-and-set: the first proposal for this identity stands; returns the stored one."""
    return _call(store.compare_set, f"{decision.prefix}/outcome", "", proposal).decode()


def _settle(store, decision: Decision, ranks: list[int], timeout_s: float) -> str:
    """Wait for every vote (or an outcome another rank already stored), then propose."""
    keys = [f"{decision.prefix}/vote/{r}" for r in ranks]
    deadline, pause = time.monotonic() + timeout_s, _POLL_S[0]
    while not _call(store.check, keys):
        stored = _outcome(store, decision)
        if stored is not None:
            return stored
        if time.monotonic() >= deadline:
            missing = [r for r, k in zip(ranks, keys) if not _call(store.check, [k])]
            return _propose(store, decision, f"{_ABORT}rank(s) {missing} did not vote within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(_POLL_S[1], pause * 2)
    values = {r: _call(store.get, k).decode() for r, k in zip(ranks, keys)}
    if len(set(values.values())) == 1:
        return _propose(store, decision, _COMMIT + next(iter(values.values())))
    return _propose(store, decision, f"{_ABORT}the ranks' values differ: {values}")


def _await_outcome(store, decision: Decision, timeout_s: float) -> str | None:
    deadline, pause = time.monotonic() + timeout_s, _POLL_S[0]
    while time.monotonic() < deadline:
        stored = _outcome(store, decision)
        if stored is not None:
            return stored
        time.sleep(pause)
        pause = min(_POLL_S[1], pause * 2)
    return _outcome(store, decision)


def _follow(decision: Decision, stored: str, mine: str) -> Outcome:
    if stored.startswith(_COMMIT):
        committed = stored[len(_COMMIT):]
        if committed == mine:
            return Outcome(True, committed, f"{decision.topic}s agree")
        # The identity covers the value, so only a digest collision or a caller that keys two
        # different values alike gets here; this rank cannot follow a commit it does not hold.
        log.error("commopt: %s: this rank's value %r is not the committed %r", decision.what, mine, committed)
        return Outcome(False, None, _message(decision, f"committed {committed!r}, this rank holds {mine!r}"))
    return Outcome(False, None, _message(decision, stored[len(_ABORT):]))


def _message(decision: Decision, why: str) -> str:
    return f"{decision.what} (group {decision.group_name}, {decision.topic} {decision.identity}): {why}"


def _store_failed(decision: Decision, e: StoreFailure) -> Outcome:
    detail = _message(decision, f"the c10d store is unreachable ({e}); its host may have died")
    log.error("commopt: %s", detail)
    return Outcome(False, None, detail)
