"""One decision for every rank: the group's first rank answers, the others adopt its answer.

Tuning may measure, and measurements differ between ranks; a rank that picked another
schedule would issue other collectives and deadlock the group.  So rank 0 of the group
computes the answer (from the cache, the model, or timings) and the others adopt it, through
the two-phase agreement of core/consistency.py keyed by the question's digest: a rank asking
the same question again (a recompile on that rank alone) gets the answer already given; a rank
asking something else, or whose first rank does not answer in time, gets `DecisionMismatch`,
and so does every rank of that question (the outcome is ``abort`` for all of them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from torch_commopt.core import consistency
from torch_commopt.tuner.cache import key_digest

log = logging.getLogger("torch_commopt.tuner.decide")


class DecisionMismatch(RuntimeError):
    """The group's ranks could not share one answer (another question, or no answer in time)."""


def decide(group_name: str | None, question: dict[str, Any], answer: Callable[[], Any], timeout_s: float) -> Any:
    """Rank 0 of the group runs `answer()`; every rank returns rank 0's (JSON) value.

    Without a usable process group (none, or the fake one of single-process tracing),
    `answer()` runs locally."""
    if group_name is None or consistency.check_skipped_reason() is not None:
        return answer()
    what = f"tuning question {question.get('question') or question.get('kind') or ''}".rstrip()
    decision = consistency.Decision("tuning", group_name, key_digest(question), what)
    outcome = consistency.lead(decision, lambda: json.dumps(answer(), default=str), timeout_s)
    if not outcome.agreed:
        raise DecisionMismatch(f"commopt tuner: {outcome.detail}")
    return json.loads(outcome.value)
