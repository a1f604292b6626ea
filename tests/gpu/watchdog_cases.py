"""Per-rank programs for the GPU-wait watchdog (kernels/gpu/watchdog.py): the last rank skips a call
that rank 0 makes, with production waits (no debug mode); rank 0 must get a WaitTimeout naming the
op, schedule and peer within the bound, its GPU must be usable afterwards, and every later call of
that group must raise at once."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from kernel_cases import _global

import torch_commopt  # noqa: F401  (registers the ops)
from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import call_graphs
from torch_commopt.kernels.gpu.watchdog import WaitTimeout

BOUND_S = 4.0
# (label, op, schedule, good calls by every rank first, the wait named): a stream wait, the fused
# kernels' spins, and a replay of a call captured with its marks (cg=1: captured at the second
# sighting of a buffer half, replayed at the next one)
STUCK_CASES = [
    ("stream wait", "rs", "ce_push:2", 1, "partial"),
    ("fused ag spin", "ag", "fused:2", 1, "chunk"),
    ("fused rs barrier", "rs", "fused:2:store=direct", 1, "barrier"),
    ("replayed graph", "ag", str(Schedule.parse("ce_push:2").with_params(cg=1)), 4, "chunk"),
]


def _op(op: str, a, w, sched: str, group_name: str, world: int):
    if op == "ag":
        return torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, group_name, sched, False)[0]
    return torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, group_name, sched)


def _caught(fn) -> tuple[str, float]:
    """fn(), then a synchronize and up to 3 bounds of Python running: (the WaitTimeout's message or
    "no error", seconds until it came)."""
    start = time.monotonic()
    try:
        fn()
        torch.cuda.synchronize()
        deadline = time.monotonic() + 3 * BOUND_S
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "no error", time.monotonic() - start
    except WaitTimeout as e:
        return str(e), time.monotonic() - start


def run_stuck_peer(rank: int, world: int):
    """For each case, on a process group of its own: every rank makes the good calls, then rank 0
    makes one more that the last rank skips.  Returns per case (label, message, seconds, whether a
    plain GPU op ran afterwards, the message of a later call of that group)."""
    os.environ.pop(env.DEBUG_WAITS, None)  # production waits (device_run.sh sets debug ones)
    os.environ[env.WAIT_TIMEOUT_S] = str(BOUND_S)
    os.environ.pop(call_graphs.ENV, None)
    a = _global(rank + 1, (512, 512), torch.bfloat16)
    w = _global(rank + 11, (512, 512), torch.bfloat16) / 32
    results = []
    for label, op, sched, good, _ in STUCK_CASES:
        group = dist.new_group(backend=dist.get_backend())
        gn = group.group_name
        for _ in range(good):
            _op(op, a, w, sched, gn, world)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            message, seconds = _caught(lambda: _op(op, a, w, sched, gn, world))
            x = torch.randn(256, 256, device="cuda")
            usable = bool(torch.isfinite(x @ x).all().item())
            later, _ = _caught(lambda: _op(op, a, w, sched, gn, world))
            results.append((label, message, seconds, usable, later))
        dist.barrier()
    return results


def run_stuck_lowlat(rank: int, world: int, debug: bool):
    """The low-latency all-reduce (matmul_ar oneshot and twoshot, and the decoding attention's
    all-gather), each on a group of its own: every rank makes one good call, then rank 0 one more
    that the last rank skips.  Production waits (the watchdog) or debug ones (the kernel's bounded
    spin).  Returns per case (label, message, seconds, whether a plain GPU op ran afterwards)."""
    from torch_commopt.kernels.gpu import lowlat, symm

    if debug:
        os.environ[env.DEBUG_WAITS] = "1"
    else:
        os.environ.pop(env.DEBUG_WAITS, None)
    os.environ[env.WAIT_TIMEOUT_S] = str(BOUND_S)
    a = _global(rank + 1, (8, 512), torch.bfloat16)
    w = _global(rank + 11, (512, 1024), torch.bfloat16) / 32
    device = torch.device("cuda", torch.cuda.current_device())

    def gather(gn):
        ll = lowlat.for_runtime(symm.runtime(gn, device))
        ll.slot((1000,), torch.float32).normal_()
        return ll.all_gather(torch.empty(world * 1000, device=device), debug=debug)

    cases = [("one-shot all-reduce", lambda gn: torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gn, "oneshot")),
             ("two-shot all-reduce", lambda gn: torch.ops.commopt.matmul_ar(a, w, None, "sum", world, gn, "twoshot")),
             ("one-shot all-gather", gather)]
    results = []
    for label, call in cases:
        gn = dist.new_group(backend=dist.get_backend()).group_name
        call(gn)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            message, seconds = _caught(lambda: call(gn))
            x = torch.randn(256, 256, device="cuda")
            results.append((label, message, seconds, bool(torch.isfinite(x @ x).all().item())))
        dist.barrier()
    return results
