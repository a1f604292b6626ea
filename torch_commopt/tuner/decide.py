"""One decision for every rank: rank 0 answers, the others adopt its answer.

Tuning may measure, and measurements differ between ranks; a rank that picked another
schedule would issue other collectives and deadlock the group.  So rank 0 of the group
computes the answer (from the cache, the model, or timings) and publishes it in the
default c10d store; the other ranks wait for it (bounded) instead of computing their own.
Each answer carries the digest of its question: a rank asking something else (another
graph, shapes, options) gets a `DecisionMismatch` rather than a wrong answer.  Like the
plan check (core/consistency.py) the store is used, not a collective, so a rank that
never comes ends in a timeout, not a hang.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from torch_commopt.core.groups import resolve_group
from torch_commopt.tuner.cache import key_digest

log = logging.getLogger("torch_commopt.tuner.decide")

_DECISIONS_PER_GROUP: Counter[str] = Counter()


class DecisionMismatch(RuntimeError):
    """Ranks asked different tuning questions (or rank 0 did not answer in time)."""


def decide(group_name: str | None, question: dict[str, Any], answer: Callable[[], Any], timeout_s: float) -> Any:
    """Rank 0 of the group runs `answer()`; every rank returns rank 0's (JSON) value.

    Without a usable process group (none, or the fake one of single-process tracing),
    `answer()` runs locally."""
    if group_name is None or not dist.is_available() or not dist.is_initialized() or dist.get_backend() == "fake":
        return answer()
    ranks = dist.get_process_group_ranks(resolve_group(group_name))
    seq = _DECISIONS_PER_GROUP[group_name]
    _DECISIONS_PER_GROUP[group_name] += 1
    key = f"commopt/tune/{group_name}/{seq}"
    asked = key_digest(question)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == ranks[0]:
        value = answer()
        store.set(key, json.dumps({"question": asked, "value": value}, default=str))
        return json.loads(json.dumps(value, default=str))  # what the others see
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception as e:  # c10d raises DistStoreError / RuntimeError on timeout
        raise DecisionMismatch(f"commopt tuner: rank {ranks[0]} published no decision #{seq} for group "
                               f"{group_name} within {timeout_s}s ({type(e).__name__})") from e
    published = json.loads(store.get(key).decode())
    if published["question"] != asked:
        raise DecisionMismatch(f"commopt tuner: decision #{seq} for group {group_name}: rank {ranks[0]} answered "
                               f"another question ({published['question']} vs {asked} here)")
    return published["value"]
