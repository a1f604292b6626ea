"""Calibration by microbenchmarks: the machine's links, GEMM fit and host costs.

Every rank of the group runs the same microbenchmarks together (the collectives need
them all); each figure is the slowest rank's (all-reduce MAX), so every rank ends with
the identical `Calibration` and therefore the identical ranking.  Sizes are small enough
for a 2-core CI machine (gloo) to finish in seconds and for 2x H200 well under 30 s.

Measured: the collectives' alpha-beta, the GEMM fit per dtype, the host cost of a
`sequential` call.  Not yet measured (taken from the prior; `Calibration.measured` lists
what was): the host cost of the other families and per piece, the copy-engine links and
the overlap / remote-store / fused factors, which need the GPU schedules' own probes.
Run it outside a compile (`python -m torch_commopt calibrate`, or `calibrate_and_store`
from every rank): issuing collectives from inside the compile pass stalled two gloo ranks
intermittently under pytest (not yet explained), so the pass only reads the cache.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from torch_commopt.kernels.reference.collectives import resolve_group
from torch_commopt.tuner.calibration import COLLECTIVES, Calibration, GemmFit, Link, prior
from torch_commopt.tuner.choose import device_name, machine_key

log = logging.getLogger("torch_commopt.tuner.calibrate")

# (m, n, k): square, wide and thin, so the fit sees both efficiency regimes
GEMM_SHAPES = {"cuda": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192), (8192, 64, 8192), (256, 8192, 8192)],
               "cpu": [(128, 128, 128), (384, 384, 384), (768, 768, 768), (768, 16, 768), (32, 768, 768)]}
COLLECTIVE_BYTES = {"cuda": (1 << 20, 16 << 20, 64 << 20), "cpu": (256 << 10, 2 << 20, 8 << 20)}


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


def fit_link(world: int, sizes: tuple[int, ...], times: tuple[float, ...], steps: float) -> Link:
    """alpha-beta of a ring collective from several sizes: t(n) = steps * (alpha + n / world / bw),
    least squares; a noisy non-positive slope falls back to the largest size's throughput."""
    x = np.array(sizes, dtype=float) / world
    y = np.array(times, dtype=float) / steps
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        return Link(alpha_s=0.0, bytes_per_s=float(x[-1] / y[-1]))
    return Link(alpha_s=max(0.0, float(intercept)), bytes_per_s=float(1.0 / slope))


def _gemm_samples(device: torch.device, dtype: torch.dtype, reps: int) -> list[tuple[int, int, int, float]]:
    out = []
    for m, n, k in GEMM_SHAPES[device.type]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((m, n, k, _timed(lambda: torch.mm(a, b), device, reps)))
    return out


def _collective_times(group, world: int, device: torch.device, reps: int) -> dict[str, tuple[float, ...]]:
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


def _host_cost(group_name: str, world: int, device: torch.device, dtype: torch.dtype) -> float:
    """Per-call cost of a tiny `sequential` op call (host-bound: dispatch + collective)."""
    a = torch.randn(8 * world, 16, device=device, dtype=dtype)
    w = torch.randn(16, 16, device=device, dtype=dtype)
    dist.barrier(group=resolve_group(group_name))
    return _timed(lambda: torch.ops.commopt.ag_matmul(a, [w], [None], 0, world, group_name, "sequential", False),
                  device, 20)


def measure(group_name: str, device: torch.device, dtype_names: tuple[str, ...] = ("float32",),
            reps: int = 5) -> Calibration:
    """Measure this machine with every rank of the group; identical result on every rank."""
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    start = time.perf_counter()
    gemm = {d: _gemm_samples(device, getattr(torch, d), reps) for d in dtype_names}
    coll = _collective_times(group, world, device, reps)
    host = _host_cost(group_name, world, device, getattr(torch, dtype_names[0]))
    flat = [t for d in dtype_names for *_, t in gemm[d]] + [t for c in COLLECTIVES for t in coll[c]] + [host]
    flat = iter(_slowest(flat, group, device))
    gemm = {d: [(m, n, k, next(flat)) for m, n, k, _ in gemm[d]] for d in dtype_names}
    coll = {c: tuple(next(flat) for _ in COLLECTIVE_BYTES[device.type]) for c in COLLECTIVES}
    host = next(flat)
    links = {c: fit_link(world, COLLECTIVE_BYTES[device.type], coll[c],
                         (world - 1) * (2 if c == "all_reduce" else 1)) for c in COLLECTIVES}
    name = device_name(device)
    base = prior(name, world)
    cal = Calibration(
        device=name, world=world, collective=links, p2p=base.p2p, p2p_pull=base.p2p_pull, local_copy=base.local_copy,
        gemm={d: fit_gemm(gemm[d]) for d in dtype_names},
        host_s={**base.host_s, "sequential": host},
        host_per_piece_s=base.host_per_piece_s,
        overlap_slowdown=base.overlap_slowdown, remote_store_slowdown=base.remote_store_slowdown,
        fused_efficiency=base.fused_efficiency, source="measured",
        measured=("collective", "gemm", "host_s.sequential"))
    log.info("commopt tuner: calibrated %s x%d in %.1f s", name, world, time.perf_counter() - start)
    return cal


def calibrate_and_store(group_name: str, device: torch.device, cache_dir: str | None = None) -> Calibration:
    """Every rank: measure together; rank 0 of the group stores the result in the tuner cache
    under this machine's key, where `Config.mode="model"` finds it."""
    from torch_commopt.tuner.cache import TunerCache

    dtypes = ("float32",) if device.type == "cpu" else ("bfloat16", "float16", "float32")
    cal = measure(group_name, device, dtypes)
    if dist.get_rank() == dist.get_process_group_ranks(resolve_group(group_name))[0]:
        TunerCache(cache_dir).put(machine_key(device_name(device), cal.world), json.loads(cal.to_json()))
    return cal


def _calibrate_worker(rank: int, world: int, cache_dir: str | None) -> str:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    return calibrate_and_store(dist.group.WORLD.group_name, device, cache_dir).to_json()


def run_calibration(world: int, backend: str = "auto", cache_dir: str | None = None) -> str:
    """Launch `world` local processes, calibrate, store; a summary of what was measured."""
    from torch_commopt.launch import run_distributed

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    start = time.perf_counter()
    cal = Calibration.from_json(run_distributed(_calibrate_worker, world, cache_dir, backend=backend, timeout_s=600)[0])
    gemm = ", ".join(f"{d} {f.peak_flops / 1e12:.1f} TFLOP/s" for d, f in cal.gemm.items())
    links = ", ".join(f"{c} {link.bytes_per_s / 1e9:.1f} GB/s + {link.alpha_s * 1e6:.0f} us"
                      for c, link in cal.collective.items())
    return (f"commopt calibrate: {cal.device} x{cal.world} ({backend}) in {time.perf_counter() - start:.1f} s: "
            f"gemm {gemm}; {links}; host {cal.host('sequential') * 1e6:.0f} us per call; "
            f"stored in {cache_dir or 'the default tuner cache'}")
