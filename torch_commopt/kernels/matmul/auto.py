"""Schedule `auto`: the built-in rule applied to each call's concrete shape.

A graph compiled with dynamic shapes runs one region for every row count it is called with
(a serving batch, a short last training batch), so no single schedule chosen at compile time
fits: the rule that picks for long GEMMs (ce_push) loses to NCCL + cuBLAS on short ones.  The
region is rewritten with `auto`, and each call resolves it here from its shapes -- the same
decision on every rank, since the ranks of an SPMD program call with the same shapes.
Resolved once per distinct shape (cached) and logged at INFO.
"""

from __future__ import annotations

import functools
import logging

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.reference.chunking import chunk_rows

log = logging.getLogger("torch_commopt.kernels.matmul.auto")
_RESOLVED: dict[tuple, str] = {}  # (kind, schedule, A shape, ...) -> what those calls run


@functools.lru_cache(maxsize=4096)
def auto_schedule(kind: str, schedule: str, a_shape: tuple[int, ...], weight_shapes: tuple[tuple[int, ...], ...],
                  dim: int | None, world: int, dtype: str, device_type: str) -> str:
    """The schedule string an `auto` call of op `kind` runs.  a_shape: the op's A operand
    (a reduction's A has the product's leading dims); dim: gather/scatter dim (None: all-reduce)."""
    sched = Schedule.parse(schedule)
    if device_type == "cuda":
        from torch_commopt.kernels.matmul.gpu.pick import measure_band, pick

        args = (kind, list(a_shape), [list(w) for w in weight_shapes], dim, world, dtype)
        graphs = bool(sched.param("graphs", 0))
        picked, why = pick(*args, graphs=graphs)
        if not graphs and measure_band(*args, graphs=graphs) is not None:
            # Where a static region times NCCL against ce_push:1 at its first call (the host's
            # speed decides), a dynamic one would time every new shape: NCCL + cuBLAS, which
            # the band's GPU schedule beats only on a fast host.  (A replayed band region's
            # candidates differ by GPU time alone: a dynamic one runs the rule's pick.)
            picked, why = Schedule("sequential"), why + ": host-bound band, NCCL + cuBLAS untimed"
        if sched.param("dbg") and picked.is_gpu:
            picked = picked.with_params(dbg=1)
    else:
        picked, why = Schedule("chunked", sched.chunks), f"the reference schedule in {sched.chunks} pieces off CUDA"
    t_shape = None if kind == "ag_matmul" else list(a_shape[:-1]) + [weight_shapes[0][-1]]
    picked = picked.clamp(chunk_rows(kind, list(a_shape), t_shape, dim, world, picked.chunks))
    log.info("commopt %s: auto runs %s for A %s (%s)", kind, picked, list(a_shape), why)
    _RESOLVED[(kind, schedule, a_shape, weight_shapes, dim, world, dtype, device_type)] = str(picked)
    return str(picked)


def resolved() -> dict[tuple, str]:
    """What the `auto` calls of this process ran: (op, schedule, A shape, weight shapes, dim,
    world, dtype, device type) -> the schedule."""
    return dict(_RESOLVED)


def reset() -> None:
    auto_schedule.cache_clear()
    _RESOLVED.clear()
