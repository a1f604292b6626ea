"""The `auto` expert-parallel schedule: the cost model's pick (cost.py), the same on every rank.

`chooser(timeout_s, cache_dir)` gives the callable that kernels/moe/module.py's forward calls
with each call's Routing when its schedule is "auto".  The question -- the call's peak rows
rounded up to a power of two, the model's and experts' dims, the local experts, the world, the
dtype and the transport -- is the same on every rank (Routing.peak is exchanged with the counts,
the transport is voted), and rank 0's answer is adopted by all (tuner/decide.py, two-phase).
Each question is asked once and remembered: a training loop's calls ask one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from torch import Tensor

from torch_commopt.kernels.moe import ce_exchange
from torch_commopt.tuner.decide import decide
from torch_commopt.tuner.machine import calibration_for, device_name
from torch_commopt.tuner.moe.cost import MoEShape, best

log = logging.getLogger("torch_commopt.tuner.moe")


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def chooser(timeout_s: float, cache_dir: str | None = None) -> Callable:
    """choose(routing, x, weights, group) -> the schedule to run ("a2a" or "by_expert:C")."""
    memo: dict[str, str] = {}
    seen: dict[tuple, str] = {}  # the same picks by a key cheap to build: every call asks, after its counts' host read

    def choose(routing, x: Tensor, weights, group) -> str:
        if weights is None or routing.world < 2:  # by_expert runs the SwiGLU itself: it needs them
            return "a2a"
        transport = "ce" if ce_exchange.usable(x, group) else "nccl"
        rows = _pow2(routing.peak if routing.peak is not None else x.shape[0])
        fast = (rows, x.shape[1], weights[0].shape[1], routing.local_experts, routing.world, x.dtype, transport,
                x.device, group.group_name)
        pick = seen.get(fast)
        if pick is not None:
            return pick
        shape = MoEShape(rows=rows, dim=x.shape[1], hidden=weights[0].shape[1], local_experts=routing.local_experts,
                         world=routing.world, dtype=str(x.dtype).removeprefix("torch."), transport=transport)
        question = {"question": "moe schedule", "device": device_name(x.device), **shape.__dict__}
        key = json.dumps(question, sort_keys=True)
        if key not in memo:
            cal = calibration_for(x.device, routing.world, group.group_name, cache_dir, timeout_s)

            def answer() -> str:
                pick, est = best(shape, cal)
                log.info("commopt moe: auto picks %s for %s (estimates, ms: %s)", pick, shape,
                         ", ".join(f"{k} {v * 1e3:.3f}" for k, v in est.items()))
                return pick

            memo[key] = decide(group.group_name, question, answer, timeout_s)
        seen[fast] = memo[key]
        return memo[key]

    return choose


def moe_chooser(cfg) -> Callable | None:
    """The chooser a Config's moe_schedule needs ("auto"), else None."""
    return chooser(cfg.consistency_timeout_s, cfg.cache_dir) if cfg.moe_schedule == "auto" else None
