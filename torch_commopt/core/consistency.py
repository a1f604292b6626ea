"""Rank consistency of rewrite decisions.

A rank that rewrites a region another rank leaves alone, or picks another schedule,
issues different collectives and deadlocks the group.  Once per compiled graph, each
rank publishes "<graph signature>:<plan hash>" in the default c10d store under a key
numbered by how many graphs it has checked for that group, waits (bounded) for the
other ranks of the group, and rewrites only if every value is equal.  The store is used
rather than a collective so that a missing rank ends in a timeout, not a hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from torch_commopt.core.groups import resolve_group

log = logging.getLogger("torch_commopt.core.consistency")

_CHECKS_PER_GROUP: Counter[tuple[str, str]] = Counter()  # (topic, group) -> checks so far


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


def ranks_agree(group_names: list[str], value: str, timeout_s: float, topic: str = "plan") -> tuple[bool, str]:
    """Publish `value` for each group and compare with the group's other ranks.  topic: what
    is compared ("plan", or "allocation" for the GPU runtime's symmetric allocations); each
    topic numbers its checks per group on its own, so checks of different topics may
    interleave differently on different ranks.

    Returns (agreed, detail).  Never blocks longer than `timeout_s` per group."""
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    for name in sorted(set(group_names)):
        ranks = dist.get_process_group_ranks(resolve_group(name))
        seq = _CHECKS_PER_GROUP[topic, name]
        _CHECKS_PER_GROUP[topic, name] += 1
        prefix = f"commopt/{topic}/{name}/{seq}"
        keys = [f"{prefix}/{r}" for r in ranks]
        try:
            store.set(f"{prefix}/{me}", value)
        except Exception as e:  # the store is unreachable: the peers time out waiting for this key
            return False, f"group {name}: could not publish this rank's {topic} ({type(e).__name__}: {e})"
        try:
            store.wait(keys, timedelta(seconds=timeout_s))
            values = {r: store.get(k).decode() for r, k in zip(ranks, keys)}
        except Exception as e:  # c10d raises DistStoreError / RuntimeError on timeout
            return False, f"group {name}: ranks did not all publish a {topic} within {timeout_s}s ({type(e).__name__})"
        if len(set(values.values())) != 1:
            return False, f"group {name}: {topic}s differ across ranks {values}"
    return True, f"{topic}s agree"
