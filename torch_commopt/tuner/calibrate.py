"""Calibration by microbenchmarks: the machine's links, GEMM fit and host costs.

Every rank of the group runs the same microbenchmarks together (the collectives need
them all); each figure is the slowest rank's (all-reduce MAX), so every rank ends with
the identical `Calibration` and therefore the identical ranking.  Sizes are small enough
for a 2-core CI machine (gloo) to finish in seconds and for 2x H200 well under 30 s.

Measured: the collectives' alpha-beta, the GEMM fit per dtype, the host cost per call and
per piece.  Not yet measured (taken from the prior, and listed as such in
`Calibration.measured`): the copy-engine links and the overlap / remote-store / fused
factors, which need the GPU schedules' own probes.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from torch_commopt.kernels.reference.collectives import resolve_group
from torch_commopt.tuner.calibration import COLLECTIVES, Calibration, GemmFit, Link, prior

log = logging.getLogger("torch_commopt.tuner.calibrate")

# (m, n, k): square, wide and thin, so the fit sees both efficiency regimes
GEMM_SHAPES = {"cuda": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192), (8192, 64, 8192), (256, 8192, 8192)],
               "cpu": [(128, 128, 128), (384, 384, 384), (768, 768, 768), (768, 16, 768), (32, 768, 768)]}
COLLECTIVE_BYTES = {"cuda": (1 << 20, 64 << 20), "cpu": (64 << 10, 4 << 20)}


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call of `fn` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _slowest(values: list[float], group, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def fit_gemm(samples: list[tuple[int, int, int, float]]) -> GemmFit:
    """Least squares (relative error) of t = launch + flops/peak + (flops/d) * half/peak."""
    rows = [(1.0, 2.0 * m * n * k, 2.0 * m * n * k / min(m, n, k)) for m, n, k, _ in samples]
    a = np.array(rows) / np.array([[t] for *_, t in samples])
    coef, *_ = np.linalg.lstsq(a, np.ones(len(samples)), rcond=None)
    launch, inv_peak, half_over_peak = (float(c) for c in coef)
    if inv_peak <= 0:  # degenerate samples: fall back to the best observed throughput
        inv_peak = min(t / (2.0 * m * n * k) for m, n, k, t in samples)
    return GemmFit(peak_flops=1.0 / inv_peak, half_dim=max(0.0, half_over_peak / inv_peak), launch_s=max(0.0, launch))


def fit_link(world: int, sizes: tuple[int, int], times: tuple[float, float], steps: float) -> Link:
    """alpha-beta from two sizes of a ring collective: t(n) = steps * (alpha + n / world / bw)."""
    (n1, n2), (t1, t2) = sizes, times
    per_byte = max((t2 - t1) / (n2 - n1), 1e-15) / steps * world  # seconds per byte of one step's payload
    alpha = max(0.0, t1 / steps - n1 / world * per_byte)
    return Link(alpha_s=alpha, bytes_per_s=1.0 / per_byte)


def _gemm_samples(device: torch.device, dtype: torch.dtype, reps: int) -> list[tuple[int, int, int, float]]:
    out = []
    for m, n, k in GEMM_SHAPES[device.type]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((m, n, k, _timed(lambda: torch.mm(a, b), device, reps)))
    return out


def _collective_times(group, world: int, device: torch.device, reps: int) -> dict[str, tuple[float, float]]:
    out = {}
    for name in COLLECTIVES:
        times = []
        for nbytes in COLLECTIVE_BYTES[device.type]:
            numel = max(world, nbytes // 4 // world * world)
            full = torch.randn(numel, device=device)
            part = torch.empty(numel // world, device=device)
            fn = {"all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group),
                  "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group),
                  "all_reduce": lambda: dist.all_reduce(full, group=group)}[name]
            dist.barrier(group=group)
            times.append(_timed(fn, device, reps))
        out[name] = tuple(times)
    return out


def _host_costs(group_name: str, world: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Per-call cost of tiny op calls (host-bound), sequential vs chunked:1 and chunked:4."""
    a = torch.randn(8 * world, 16, device=device, dtype=dtype)
    w = torch.randn(16, 16, device=device, dtype=dtype)
    out = {}
    for sched in ("sequential", "chunked:1", "chunked:4"):
        fn = lambda s=sched: torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, group_name, s, False)  # noqa: E731
        dist.barrier(group=resolve_group(group_name))
        out[sched] = _timed(fn, device, 20)
    return out


def measure(group_name: str, device: torch.device, dtype_names: tuple[str, ...] = ("float32",),
            reps: int = 5) -> Calibration:
    """Measure this machine with every rank of the group; identical result on every rank."""
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    start = time.perf_counter()
    gemm = {d: _gemm_samples(device, getattr(torch, d), reps) for d in dtype_names}
    coll = _collective_times(group, world, device, reps)
    host = _host_costs(group_name, world, device, getattr(torch, dtype_names[0]))
    flat = [t for d in dtype_names for *_, t in gemm[d]] + [t for c in COLLECTIVES for t in coll[c]] + list(host.values())
    flat = iter(_slowest(flat, group, device))
    gemm = {d: [(m, n, k, next(flat)) for m, n, k, _ in gemm[d]] for d in dtype_names}
    coll = {c: (next(flat), next(flat)) for c in COLLECTIVES}
    host = {s: next(flat) for s in host}
    links = {c: fit_link(world, COLLECTIVE_BYTES[device.type], coll[c],
                         (world - 1) * (2 if c == "all_reduce" else 1)) for c in COLLECTIVES}
    base = prior(device.type if device.type == "cpu" else torch.cuda.get_device_name(device), world)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name(device)
    cal = Calibration(
        device=name, world=world, collective=links, p2p=base.p2p, p2p_pull=base.p2p_pull, local_copy=base.local_copy,
        gemm={d: fit_gemm(gemm[d]) for d in dtype_names},
        host_s={**base.host_s, "sequential": host["sequential"], "chunked": host["chunked:1"]},
        host_per_piece_s=max(0.0, (host["chunked:4"] - host["chunked:1"]) / 3),
        overlap_slowdown=base.overlap_slowdown, remote_store_slowdown=base.remote_store_slowdown,
        fused_efficiency=base.fused_efficiency, source="measured",
        measured=("collective", "gemm", "host_s", "host_per_piece_s"))
    log.info("commopt tuner: calibrated %s x%d in %.1f s", name, world, time.perf_counter() - start)
    return cal

