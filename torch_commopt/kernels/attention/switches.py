"""The attention transports' environment switches, checked per call, and their logs, once each.

TORCH_COMMOPT_ATTENTION_TRANSPORT (ce_ring.py: the ring's K/V; ce_gather.py: the flex
all-gather's K/V and dK/dV) names "auto", "nccl" or "ce", and TORCH_COMMOPT_ATTENTION_A2A
(ce_a2a.py: Ulysses's all-to-alls) "nccl" or "ce"; both read by core/env.py.  An unknown value
is logged and read as nccl (a typo must not stop a training step).
"""

from __future__ import annotations

import logging

TRANSPORTS = ("nccl", "ce")
_logged: set[tuple[str, str]] = set()


def once(log: logging.Logger, key: str, level: int, msg: str, *args) -> None:
    """log.log(level, msg, *args) the first time this logger sees `key`."""
    if (log.name, key) not in _logged:
        _logged.add((log.name, key))
        log.log(level, msg, *args)


def transport(log: logging.Logger, name: str, want: str, choices: tuple[str, ...] = TRANSPORTS) -> str:
    """`want`, the transport environment variable `name` asks for (core/env.py, normalized), or
    nccl where it names none of `choices`."""
    if want not in choices:
        once(log, f"bad {name}={want}", logging.WARNING, "commopt attention: %s=%r is not one of %s; using nccl", name,
             want, choices)
        return "nccl"
    return want
