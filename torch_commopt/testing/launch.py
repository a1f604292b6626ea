"""Run a function on W local processes with a process group each (gloo on CPU, NCCL on GPUs).

Used by the demo and the tests.  Bounded: a run that does not finish within `timeout_s`
is killed and reported, never waited on forever.

On a machine without a visible CUDA device the ranks are forked from a fork server that
imported torch and torch_commopt once (where the platform has one): a spawned rank spends ~3 s
of CPU importing them, which on the 2-core CI machine would be half of the test suite's time; the
server also does inductor's once-per-process work (testing/warm.py).  A rank takes the caller's
environment as it is at the call (the fork server's is the one it started with), and nothing in
torch_commopt reads its switches at import (inductor's vector-ISA pick is the fork server's).
With CUDA devices the ranks are spawned: the preload initializes CUDA in the server, and torch refuses CUDA in a
process forked after that ("Cannot re-initialize CUDA in forked subprocess").
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

FAILED_PEER_GRACE_S = 20.0
POLL_S = 2.0
FINISHED_KEY, ALL_FINISHED_KEY = "commopt/launch/finished", "commopt/launch/all_finished"
LEAVE_WAIT_S = 3600.0  # rank 0's wait for the others at exit (the parent's timeout comes first)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports before it forks any rank (warm: inductor's once-per-process work).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "torch_commopt",
           "torch_commopt.testing.warm")


def _context(backend: str = "gloo"):
    """The multiprocessing context the ranks start from: a fork server with PRELOAD imported
    where the platform has one and the ranks cannot use CUDA (gloo, no CUDA device visible),
    else spawn."""
    import multiprocessing

    import torch

    cuda = backend == "nccl" or torch.cuda.is_available()
    if cuda or "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _worker(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue,
            env: dict[str, str] | None = None) -> None:
    if env is not None:  # the caller's environment at the call, not the fork server's
        os.environ.clear()
        os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif "OMP_NUM_THREADS" not in os.environ:
            # torchrun's default for several processes: W ranks each with torch's default thread
            # count oversubscribe the cores (and on the 2-core CI machine, ranks with two threads
            # can show a rare precision-level deviation in plain torch ops)
            torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
        result = fn(rank, world, *args)
        queue.put((rank, True, result))
        if dist.is_initialized():
            _leave_together(rank, world)  # (a failed run is the parent's to end: it kills the rest)
    except BaseException:  # report every failure, including asserts, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(rank: int, world: int) -> None:
    """Rank 0 hosts the c10d store: it stays until every rank has finished, so that a rank
    done early (e.g. one TP group of a DP x TP mesh, which never waits for the other) does not
    take the store down under ranks still using it (broken pipe in their next store call).
    The others leave at once; a rank that dies is the parent's to report (it kills the rest)."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        if store.add(FINISHED_KEY, 1) == world:  # the last one to finish says so
            store.set(ALL_FINISHED_KEY, "1")
        if rank == 0:
            store.wait([ALL_FINISHED_KEY], timedelta(seconds=LEAVE_WAIT_S))
    except Exception:  # noqa: BLE001 - the store is already gone: nothing left to protect
        pass


def run_distributed(fn: Callable, world: int, *args: Any, backend: str = "gloo", timeout_s: float = 900) -> list[Any]:
    """Run fn(rank, world, *args) on `world` processes (forked from the fork server without
    CUDA, else spawned); return the per-rank results.

    Raises RuntimeError with the failing ranks' tracebacks, or on timeout."""
    ctx = _context(backend)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, queue, env), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    exited: dict[int, float] = {}  # rank -> when its process was first seen gone without a report
    try:
        while len(results) + len(errors) < world:
            try:
                rank, ok, payload = queue.get(timeout=POLL_S)
                (results if ok else errors)[rank] = payload
            except queue_module.Empty:
                now = time.monotonic()
                # A rank killed by a signal (a crash in native code) never reports: say so instead
                # of waiting out the timeout (after one more poll, for a report still in the pipe).
                for r, p in enumerate(procs):
                    if r in results or r in errors or p.exitcode is None:
                        continue
                    if now - exited.setdefault(r, now) >= POLL_S:
                        errors[r] = f"process exited with code {p.exitcode} without reporting (a crash in native code?)"
                if now > deadline:
                    raise
            if errors:
                # Once a rank has failed, its peers may sit in a collective it never joins:
                # give them a short grace period, then kill them.
                deadline = min(deadline, time.monotonic() + FAILED_PEER_GRACE_S)
    except Exception as e:  # queue.Empty on timeout
        missing = sorted(set(range(world)) - set(results) - set(errors))
        errors[-1] = f"ranks {missing} did not finish ({type(e).__name__}); killed"
    finally:
        for p in procs:  # after a failure, a rank still alive only waits for peers that will not come
            p.join(timeout=3 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed:\n" + "\n".join(f"[rank {r}] {t}" for r, t in sorted(errors.items())))
    return [results[r] for r in range(world)]
