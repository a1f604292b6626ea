"""Calibration by microbenchmarks: the machine's links, GEMM fit and host costs.

Every rank of the group runs the same microbenchmarks together (the collectives need
them all); each figure is the slowest rank's (all-reduce MAX), so every rank ends with
the identical `Calibration` and therefore the identical ranking.  Sizes are small enough
for a 2-core CI machine (gloo) to finish in seconds and for 2x H200 well under 30 s.

Measured (`Calibration.measured` lists it): the collectives' alpha-beta, the GEMM fit per
dtype (device time, sustained clocks), the host cost of a call per schedule family and per
piece; on GPUs also the copy-engine links (push, pull, local copy) and the GEMM slowdowns
beside a copy-engine push, beside an NCCL collective and when storing into a peer, the
small all-reduces' latency (NCCL's, one-shot's and two-shot's, 4 KiB to 8 MiB, replayed), and
then each schedule family's measured / predicted time on a probe shape (M_global 12288,
K = N = 6144 -- not a benchmark shape), which the model applies to that family.  Taken from
the prior: the Triton GEMM's speed relative to cuBLAS (`fused_efficiency`; the fused
family's factor absorbs what it misses) and the sm_90a kernels' (`sm90_efficiency`; their
probes' own factors, `fused:1:impl=sm90`, absorb what it misses).
The schedule probes and their factors are `probe_factors.py`'s.
Run it outside a compile (`python -m torch_commopt calibrate`, or `calibrate_and_store`
from every rank): issuing collectives from inside the compile pass stalled two gloo ranks
intermittently under pytest (not yet explained), so the pass only reads the cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.matmul.ops import runner
from torch_commopt.tuner.calibration import COLLECTIVES, Calibration, GemmFit, Link, gemm_occupancy, prior
from torch_commopt.tuner.gemm_table import time_gemms
from torch_commopt.tuner.machine import device_name, machine_key
from torch_commopt.tuner.probe_factors import (
    SHORT_PROBE_SHAPES,
    _call_graph_slowdown,
    _eager_over_replayed,
    _factor_curves,
    _per_call_probes,
    _probe_gemm_keys,
    _schedule_factors,
    _schedule_probes,
    _unmeasured_families,
)
from torch_commopt.tuner.timing import SLEEP_CYCLES_PER_CALL, device_time

log = logging.getLogger("torch_commopt.tuner.calibrate")

# (m, n, k): square, wide and thin, so the fit sees both efficiency regimes.  No sample of a
# chunked reduction's piece (1024 x 8192 x 4096) is needed: fit_gemm's roofline, fitted to these
# five, predicts it within 1%, and adding it as a sixth sample leaves the picks unchanged
# (docs/tuner.md, "Calibration").
GEMM_SHAPES = {"cuda": [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192), (8192, 64, 8192), (256, 8192, 8192)],
               "cpu": [(128, 128, 128), (384, 384, 384), (768, 768, 768), (768, 16, 768), (32, 768, 768)]}
COLLECTIVE_BYTES = {"cuda": (1 << 20, 16 << 20, 64 << 20), "cpu": (256 << 10, 2 << 20, 8 << 20)}
P2P_BYTES = (4 << 20, 64 << 20)
WARM_S = 1.0  # seconds of GEMMs before the GEMM samples
# The representative call of each schedule family whose host cost is measured (tiny shapes);
# the first probe of a family gives its figure, and each probe also its op's own ("matmul_rs
# ce_push"): the reductions' ce_push enqueues more than the all-gather's (RS ~170 us, AR ~210
# us a call against the all-gather's ~145 us), so the all-gather's figure under-prices an eager
# reduction.  `fused` (a Triton launch) needs a probe of its own: its eager call costs 0.35-0.46
# ms of host at M_global 512 (~0.1 of GPU), and the prior's 160 us would rank it first where
# it runs 2.2-2.7x the best (docs/tuner.md, "Calibration").
HOST_PROBES = {"cpu": [("ag_matmul", "sequential"), ("ag_matmul", "local_first"), ("matmul_rs", "chunked:2")],
               "cuda": [("ag_matmul", "sequential"), ("ag_matmul", "local_first"), ("matmul_rs", "chunked:2"),
                        ("ag_matmul", "ce_push:1"), ("ag_matmul", "ce_push:4"), ("matmul_rs", "ce_pull:2"),
                        ("matmul_rs", "direct:1"), ("matmul_rs", "ce_push:1"), ("matmul_ar", "ce_push:1"),
                        ("ag_matmul", "ce_push:1:par=1"), ("matmul_rs", "ce_push:4"), ("matmul_ar", "ce_push:4"),
                        ("ag_matmul", "fused:1"), ("matmul_rs", "fused:1"), ("ag_matmul", "fused:1:impl=sm90"),
                        ("matmul_rs", "fused:1:impl=sm90")]}


def _host_time(fn, device: torch.device, calls: int = 30) -> float:
    """Wall seconds per call of back-to-back calls of a tiny op: its host cost (the device
    work is shorter than the enqueue, and buffers recycle as they would in a program)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def _slowest(values: list[float], group, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _slowest_figures(figures: dict[str, float], group, device: torch.device) -> dict[str, float]:
    return dict(zip(figures, _slowest(list(figures.values()), group, device)))


# Two passes of a set of figures further apart than this (relative) get a third pass and the
# per-figure median: one pass measured in a host burst or beside a stray transfer bends what is
# derived from it (a pass reading the sequential call's host at 134 us against 69-111 us, and
# no GEMM slowdown beside NCCL against 0.83-0.85, ranks a slower schedule first and costs the
# plan a few percent).
AGREE = 0.10


def disagreeing(first: dict[str, float], second: dict[str, float], tolerance: float = AGREE) -> list[str]:
    """The figures of two passes further apart than `tolerance` of the smaller."""
    return [k for k in first if abs(first[k] - second[k]) > tolerance * max(min(first[k], second[k]), 1e-12)]


def agreed(passes: list[dict[str, float]], another: Callable[[], dict[str, float]],
           label: str) -> tuple[dict[str, float], list[str]]:
    """(per-figure median of two passes that agree (within AGREE), else of three, the figures
    that disagreed): `another()` measures the third.  The passes must already be the slowest
    rank's (the same on every rank, so every rank takes the same branch and issues the same
    collectives)."""
    far = disagreeing(*passes)
    if far:
        passes = passes + [another()]
        log.info("commopt calibrate: %s figures %s disagreed by more than %.0f%% between two passes "
                 "(%s vs %s); a third pass: %s", label, far, AGREE * 100, [round(passes[0][k], 7) for k in far],
                 [round(passes[1][k], 7) for k in far], [round(passes[2][k], 7) for k in far])
    return {k: statistics.median(p[k] for p in passes) for k in passes[0]}, far


def fit_gemm(samples: list[tuple[int, int, int, float]], sms: int = 0) -> GemmFit:
    """The roofline GemmFit of the samples, least squares in relative error.  A sample is
    memory-bound where its intensity 2mnk / (mk + kn + mn) is below peak / elems_per_s, so the
    bound split is a threshold in intensity: every threshold is tried (a linear fit of launch,
    1 / peak and 1 / elems_per_s each) and the one whose roofline fits best is kept.  A side of
    the split with no sample takes the best rate observed (an upper bound the fit cannot see).
    sms: the device's SM count (0 on CPUs): a sample's flops count at its occupancy
    (gemm_occupancy)."""
    flops = np.array([2.0 * m * n * k / gemm_occupancy(m, n, sms) for m, n, k, _ in samples])
    elems = np.array([float(m * k + k * n + m * n) for m, n, k, _ in samples])
    t = np.array([s[3] for s in samples])
    best = None
    for cut in sorted({0.0, *(flops / elems)}):
        memory = flops / elems <= cut
        a = np.stack([np.ones_like(t), np.where(memory, 0.0, flops), np.where(memory, elems, 0.0)], 1) / t[:, None]
        launch, inv_peak, inv_elems = (float(c) for c in np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0])
        fit = GemmFit(peak_flops=1.0 / inv_peak if inv_peak > 0 and (~memory).any() else float(max(flops / t)),
                      elems_per_s=1.0 / inv_elems if inv_elems > 0 and memory.any() else float(max(elems / t)),
                      launch_s=max(0.0, launch), sms=sms)
        err = sum((fit.time(m, n, k) / s - 1.0) ** 2 for m, n, k, s in samples)
        if best is None or err < best[0]:
            best = (err, fit)
    return best[1]


def _sm_count(device: torch.device) -> int:
    """The SMs gemm_occupancy counts against: the device's, 0 on CPUs."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def fit_link(world: int, sizes: tuple[int, ...], times: tuple[float, ...], steps: float) -> Link:
    """alpha-beta of a ring collective from several sizes: t(n) = steps * (alpha + n / world / bw),
    least squares; a fit bent by an outlier (non-positive slope, or a negative latency) falls
    back to the best throughput among the sizes."""
    x = np.array(sizes, dtype=float) / world
    y = np.array(times, dtype=float) / steps
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0 or intercept < -0.05 * y.min():  # an outlier bent the line: the best throughput seen
        return Link(alpha_s=0.0, bytes_per_s=float(max(x / y)))
    return Link(alpha_s=max(0.0, float(intercept)), bytes_per_s=float(1.0 / slope))


def _settle(device: torch.device, seconds: float, dtype: torch.dtype = torch.bfloat16) -> None:
    """`seconds` of back-to-back 8192^3 GEMMs (CUDA): GEMMs at full power lower the clocks, and
    what follows is measured at the clocks a busy program runs at."""
    if device.type != "cuda" or seconds <= 0:
        return
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize(device)


def _gemm_samples(device: torch.device, dtype: torch.dtype, reps: int) -> list[tuple[int, int, int, float]]:
    out = []
    _settle(device, WARM_S, dtype)  # the samples at settled clocks
    for m, n, k in GEMM_SHAPES[device.type]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append((m, n, k, device_time(lambda: torch.mm(a, b), device, reps, preroll=device.type == "cuda")))
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
            times.append(device_time(fn, device, reps, group))
        out[name] = tuple(times)
    return out


def _consistent(sizes: tuple[int, ...], times: tuple[float, ...]) -> bool:
    """Whether t = alpha + n / bw fits the samples: positive slope, no negative latency, every
    sample within 25% of the line."""
    x, y = np.array(sizes, dtype=float), np.array(times, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return bool(slope > 0 and intercept >= -0.05 * y.min() and np.max(np.abs(intercept + slope * x - y) / y) <= 0.25)


def _collective_times_checked(group, world: int, device: torch.device, reps: int) -> dict[str, tuple[float, ...]]:
    """_collective_times, slowest rank's, measured a second time when a line does not fit
    them (an outlier -- one 64 MiB all-reduce at 1/40 of its bandwidth happens now and then --
    bends the alpha-beta fit); each sample is then the faster of its two measurements.
    Every rank sees the same figures, so all ranks re-measure alike."""
    def slowest(times: dict[str, tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
        flat, n = _slowest([t for c in COLLECTIVES for t in times[c]], group, device), len(COLLECTIVE_BYTES[device.type])
        return {c: tuple(flat[i * n:(i + 1) * n]) for i, c in enumerate(COLLECTIVES)}

    out = slowest(_collective_times(group, world, device, reps))
    if all(_consistent(COLLECTIVE_BYTES[device.type], t) for t in out.values()):
        return out
    second = slowest(_collective_times(group, world, device, reps))
    log.info("commopt calibrate: no line fits the collective timings (%s); measured again: %s", out, second)
    return {c: tuple(min(a, b) for a, b in zip(out[c], second[c])) for c in COLLECTIVES}


# Calibration.small_msg: products of (rows, N) bf16 from 4 KiB to 8 MiB (a decoder's row-parallel
# projections at batch 1-64, and past the low-latency band's 1 MiB end), each the product of a
# short GEMM (K = SMALL_MSG_K) so that the all-reduce is the call.
SMALL_MSG_SHAPES = ((1, 2048), (8, 4096), (64, 4096), (256, 4096), (1024, 4096))
SMALL_MSG_K = 256
SMALL_MSG_SCHEDULES = ("sequential", "oneshot", "twoshot")


def _small_message_times(group_name: str, world: int, device: torch.device, reps: int) -> dict[str, list[list[float]]]:
    """{schedule: [[product bytes, seconds], ...]} of NCCL's and the low-latency all-reduces
    alone: matmul_ar calls replayed from CUDA graphs (as a decoder runs them; the tuner's timing,
    slowest rank) less their GEMM's device time (slowest rank).  A schedule whose capture fails
    (NCCL on ranks sharing a GPU over gloo) is left out of every rank's table alike."""
    from torch_commopt.tuner.matmul.autotune import Timing, measure_candidates

    group = resolve_group(group_name)
    out: dict[str, list[list[float]]] = {}
    for rows, n in SMALL_MSG_SHAPES:
        a = torch.randn(rows, SMALL_MSG_K, device=device, dtype=torch.bfloat16)
        w = torch.randn(SMALL_MSG_K, n, device=device, dtype=torch.bfloat16) / SMALL_MSG_K ** 0.5
        run = runner("matmul_ar", a, [w], world, group_name)
        ms = measure_candidates(run, list(SMALL_MSG_SCHEDULES), group_name, device, "small all-reduce",
                                timing=Timing(graphs=True, paired=False))
        (gemm_s,) = _slowest([device_time(lambda: torch.mm(a, w), device, reps)], group, device)
        for sched, t in ms.items():  # never below 0.1 us: a GEMM timed slower alone than in the call
            out.setdefault(sched, []).append([float(rows * n * 2), max(t / 1e3 - gemm_s, 1e-7)])
    return out


# one block of local attention: (B, H, S, D) per device type
ATTENTION_PROBE = {"cuda": (1, 32, 4096, 128), "cpu": (1, 4, 256, 64)}
ATTENTION_ROUNDS = 3


def _attention_times(device: torch.device, dtype: torch.dtype, reps: int) -> tuple[float, float, float]:
    """(flops, forward s, backward s) of one full (non-causal) block of local attention, the
    backend kernels/attention/local.py picks for this device and dtype."""
    from torch_commopt.kernels.attention.local import attend_bwd, attend_fwd

    b, h, s, d = ATTENTION_PROBE[device.type]
    q, k, v, dout = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(4))
    scale = d ** -0.5
    out, lse = attend_fwd(q, k, v, scale=scale)
    fwd, bwd = [], []
    for _ in range(ATTENTION_ROUNDS):  # interleaved: a slow spell of the host lands on both alike
        fwd.append(device_time(lambda: attend_fwd(q, k, v, scale=scale), device, reps))
        bwd.append(device_time(lambda: attend_bwd(dout, (q, k, v, out.to(dtype), lse), scale=scale), device, reps))
    return 4.0 * b * h * s * s * d, statistics.median(fwd), statistics.median(bwd)


def _bwd_factor(attn: dict[str, tuple[float, float, float]]) -> float:
    """The backward's time over the forward's (median over dtypes), from the slowest rank's
    figures (so every rank decides alike).  The backward runs five matmuls to the forward's two
    (the scores again, dV, dP, dQ, dK), so a factor at or below 1 is a disturbed measurement,
    not the kernel: 0 (the attention model's default factor), logged."""
    factor = statistics.median(b / t for _, t, b in attn.values())
    if factor > 1.0:
        return factor
    log.warning("commopt calibrate: attention backward timed %.2fx its forward (the backward does more than "
                "twice the work): a disturbed measurement, the attention model's default factor is used", factor)
    return 0.0


def _host_costs(group_name: str, world: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """{"kind schedule": seconds} host cost per call of each HOST_PROBES entry."""
    a = torch.randn(64 * world, 256, device=device, dtype=dtype)
    w = torch.randn(256, 256, device=device, dtype=dtype)
    out = {}
    for kind, sched in HOST_PROBES[device.type]:
        run = runner(kind, a, [w], world, group_name)
        dist.barrier(group=resolve_group(group_name))
        out[f"{kind} {sched}"] = _host_time(lambda s=sched: run(s), device)  # fixed call counts: the same on every rank
    return out


def _gpu_probes(group_name: str, world: int, device: torch.device, reps: int) -> dict[str, float]:
    """Copy-engine links (push into / pull from a peer's symmetric buffer, local copy), and
    the slowdowns: GEMM beside a copy-engine push, beside an NCCL all-gather, and with its
    output stored into a peer's buffer.  Times in seconds."""
    from torch_commopt.kernels.gpu import symm

    group = resolve_group(group_name)
    rt = symm.runtime(group_name, device)
    peer = rt.peers[0]
    buf = rt.buffer(2 * P2P_BYTES[-1])
    out = {}
    for nbytes in P2P_BYTES:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        remote = buf.view(peer, 0, (nbytes,), torch.uint8)
        local = buf.view(rt.rank, nbytes if 2 * nbytes <= buf.nbytes else 0, (nbytes,), torch.uint8)
        dist.barrier(group=group)
        out[f"push {nbytes}"] = device_time(lambda: remote.copy_(src), device, reps)
        dist.barrier(group=group)
        out[f"pull {nbytes}"] = device_time(lambda: src.copy_(remote), device, reps)
        out[f"local {nbytes}"] = device_time(lambda: local.copy_(src), device, reps)
    dist.barrier(group=group)
    a = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    c = torch.empty(8192, 4096, device=device, dtype=torch.bfloat16)
    out["gemm"] = device_time(lambda: torch.mm(a, b, out=c), device, reps)
    src = torch.empty(P2P_BYTES[-1] // 2, dtype=torch.uint8, device=device)
    remote = buf.view(peer, 0, (src.numel(),), torch.uint8)
    out["push half"] = device_time(lambda: remote.copy_(src), device, reps)

    def gemm_beside_push():
        rt.side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(rt.side):
            remote.copy_(src)
        torch.mm(a, b, out=c)
        torch.cuda.current_stream(device).wait_stream(rt.side)

    dist.barrier(group=group)
    out["gemm beside push"] = device_time(gemm_beside_push, device, reps)
    dist.barrier(group=group)
    out["push alone"], out["push beside gemms"] = _push_timings(
        rt.side, remote, src, lambda: torch.mm(a, b, out=c), out["gemm"], out["push half"], device, reps)
    full = torch.empty(world * (P2P_BYTES[-1] // 4), device=device, dtype=torch.bfloat16)
    part = full[: full.numel() // world]
    dist.barrier(group=group)
    out["gather"] = device_time(lambda: dist.all_gather_into_tensor(full, part, group=group), device, reps, group)

    def gemm_beside_gather():
        work = dist.all_gather_into_tensor(full, part, group=group, async_op=True)
        torch.mm(a, b, out=c)
        work.wait()

    dist.barrier(group=group)
    out["gemm beside gather"] = device_time(gemm_beside_gather, device, reps, group)
    remote_c = buf.view(peer, 0, (8192, 4096), torch.bfloat16)
    dist.barrier(group=group)
    out["gemm into peer"] = device_time(lambda: torch.mm(a, b, out=remote_c), device, reps)
    dist.barrier(group=group)
    return out


def _push_timings(side, remote: torch.Tensor, src: torch.Tensor, gemm, gemm_s: float, push_s: float,
                  device: torch.device, reps: int) -> tuple[float, float]:
    """(alone, beside GEMMs): median seconds of one push of `src` into `remote` on the `side`
    stream, timed by events on that stream, on its own and while `gemm` calls (gemm_s each; the
    push push_s back to back) run on the current stream before, throughout and after it (every
    rank pushes to its peer at once, as the schedules do).  Both behind a sleep, so the host
    enqueues everything first."""
    cur = torch.cuda.current_stream(device)
    cover = 2 + math.ceil(2 * push_s / max(gemm_s, 1e-9))  # GEMMs after the push's start: twice its time
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps + 1):
        for beside in (False, True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            go = torch.cuda.Event()
            torch.cuda._sleep(int(SLEEP_CYCLES_PER_CALL * (cover + 4)))
            if beside:
                gemm()  # the push starts once this GEMM is done: GEMMs run before and after it
            go.record(cur)
            for _ in range(cover if beside else 0):
                gemm()
            side.wait_event(go)
            with torch.cuda.stream(side):
                start.record()
                remote.copy_(src)
                end.record()
            cur.wait_stream(side)
            end.synchronize()
            samples[beside].append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples[False][1:]), statistics.median(samples[True][1:])


LAST_PHASES: dict[str, float] = {}  # this process's last measure(): seconds per phase (bench_costmodel records them)

TRANSFER_SLOWDOWN_MAX = 2.0  # a push 3x slower beside GEMMs than alone is a broken probe, not a slowdown


def _transfer_slowdown(beside: float, alone: float) -> float:
    """A transfer's time beside GEMMs over its time alone, less 1, in [0, TRANSFER_SLOWDOWN_MAX]."""
    return min(TRANSFER_SLOWDOWN_MAX, max(0.0, beside / max(alone, 1e-12) - 1.0))


def _slowdown(both: float, longer: float, shorter: float) -> float:
    """s in both = longer + s * shorter (clamped to [0, 1])."""
    return min(1.0, max(0.0, (both - longer) / max(shorter, 1e-9)))


def measure(group_name: str, device: torch.device, dtype_names: tuple[str, ...] = ("float32",),
            reps: int = 5) -> Calibration:
    """Measure this machine with every rank of the group; identical result on every rank."""
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    start = time.perf_counter()
    phases = LAST_PHASES  # seconds per phase, logged with the total (the < 30 s budget's breakdown)
    phases.clear()
    mark = start

    def lap(name: str) -> None:  # the time since the last lap goes to `name`
        nonlocal mark
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - mark
        mark = now
    host_pass = lambda: _slowest_figures(_host_costs(group_name, world, device, getattr(torch, dtype_names[0])),  # noqa: E731
                                         group, device)
    hosts = [host_pass()]  # passes apart in time: a host burst rarely spans them
    lap("host")
    gemm = {d: _gemm_samples(device, getattr(torch, d), reps) for d in dtype_names}
    lap("gemm")
    coll = _collective_times_checked(group, world, device, reps)  # already the slowest rank's
    lap("collectives")
    hosts.append(host_pass())
    lap("host")
    probes, far_probes, small = {}, [], {}
    if device.type == "cuda" and world > 1:
        probe_pass = lambda: _slowest_figures(_gpu_probes(group_name, world, device, reps), group, device)  # noqa: E731
        probes, far_probes = agreed([probe_pass(), probe_pass()], probe_pass, "copy-engine and overlap")
        lap("copy-engine probes")
        small = _small_message_times(group_name, world, device, reps)
        lap("small all-reduces")
    attn = {d: _attention_times(device, getattr(torch, d), reps) for d in dtype_names}
    lap("attention")
    hosts, far_hosts = agreed(hosts, host_pass, "host")
    lap("host")
    flat = [t for d in dtype_names for *_, t in gemm[d]]
    flat += [t for d in dtype_names for t in attn[d][1:]]
    flat = iter(_slowest(flat, group, device))
    gemm = {d: [(m, n, k, next(flat)) for m, n, k, _ in gemm[d]] for d in dtype_names}
    attn = {d: (attn[d][0], next(flat), next(flat)) for d in dtype_names}
    bwd_factor = _bwd_factor(attn)
    links = {c: fit_link(world, COLLECTIVE_BYTES[device.type], coll[c],
                         (world - 1) * (2 if c == "all_reduce" else 1)) for c in COLLECTIVES}
    name = device_name(device)
    base = prior(name, world)
    by_kind = _per_piece_by_kind(hosts, world)
    host_s, per_piece = _host_families(hosts, world, base.host_per_piece_s, by_kind)
    fields = dict(p2p=base.p2p, p2p_pull=base.p2p_pull, local_copy=base.local_copy,
                  overlap_slowdown=base.overlap_slowdown, collective_overlap_slowdown=base.collective_overlap_slowdown,
                  remote_store_slowdown=base.remote_store_slowdown)
    measured = (["collective", "gemm", "host_s"] + (["host_per_piece_s"] if "ag_matmul ce_push:4" in hosts else [])
                + (["host_per_piece_by_kind"] if by_kind else []))
    if probes:
        one = lambda kind: fit_link(1, P2P_BYTES, tuple(probes[f"{kind} {n}"] for n in P2P_BYTES), 1.0)  # noqa: E731
        g = probes["gemm"]
        fields.update(
            p2p=one("push"), p2p_pull=one("pull"), local_copy=one("local"),
            overlap_slowdown=_slowdown(probes["gemm beside push"], g, probes["push half"]) if g > probes["push half"]
            else base.overlap_slowdown,
            collective_overlap_slowdown=_slowdown(probes["gemm beside gather"], max(g, probes["gather"]),
                                                  min(g, probes["gather"])),
            remote_store_slowdown=max(0.0, probes["gemm into peer"] / g - 1.0),
            transfer_slowdown=_transfer_slowdown(probes["push beside gemms"], probes["push alone"]))
        measured += ["p2p", "p2p_pull", "local_copy", "overlap_slowdown", "collective_overlap_slowdown",
                     "remote_store_slowdown", "transfer_slowdown"]
    cal = Calibration(
        device=name, world=world, collective=links, gemm={d: fit_gemm(gemm[d], _sm_count(device)) for d in dtype_names},
        gemm_samples={d: [list(sample) for sample in gemm[d]] for d in dtype_names},
        host_s={**base.host_s, **host_s}, host_per_piece_s=per_piece, host_per_piece_by_kind=by_kind,
        fused_efficiency=base.fused_efficiency, sm90_efficiency=dict(base.sm90_efficiency),
        sm90_partial_bytes_per_s=base.sm90_partial_bytes_per_s,
        attention_flops={d: f / t for d, (f, t, _) in attn.items()},
        attention_bwd_factor=bwd_factor, small_msg=small,
        source="measured", measured=tuple(measured) + ("attention_flops",) + (("attention_bwd_factor",) if bwd_factor else ())
        + (("small_msg",) if small else ()),
        remeasured=tuple(f"host {k}" for k in far_hosts) + tuple(f"probe {k}" for k in far_probes), **fields)
    lap("fits")
    if probes:  # the probes' own GEMMs timed at their shapes, so their factors hold no GEMM-fit error
        keys = _probe_gemm_keys(cal)
        table = dict(zip(keys, _slowest(list(time_gemms(keys, device).values()), group, device)))
        cal = dataclasses.replace(cal, gemm_table=table, measured=cal.measured + ("gemm_table",))
        lap("probe GEMMs")
    if probes:  # the families on probe shapes, against the model with everything above
        long_timed = _schedule_probes(group_name, world, device)  # already the slowest rank's
        long = _schedule_factors(long_timed, cal)
        lap("schedule probes")
        timed = _schedule_probes(group_name, world, device, SHORT_PROBE_SHAPES, graphs=True)
        # the model's own raw prediction: factors are applied to it, not to a corrected one
        short = _schedule_factors(timed, cal, SHORT_PROBE_SHAPES, graphs=True)
        lap("short probes, replayed")
        per_call = _call_graph_slowdown(_per_call_probes(group_name, world, device), timed)
        lap("short probes, per-call graphs")
        # the long probes replayed as well: device time alone, for replayed calls
        long_replayed = _schedule_factors(_schedule_probes(group_name, world, device, graphs=True), cal, graphs=True)
        lap("schedule probes, replayed")
        factors = {k: f for k, (_, f) in long.items()}
        factors.update(_unmeasured_families(list(long_timed), factors, long_replayed))
        cal = dataclasses.replace(cal, schedule_factor=factors,
                                  eager_over_replayed=_eager_over_replayed(long, long_replayed),
                                  schedule_factor_curve=_factor_curves(long, short),
                                  schedule_factor_curve_graphs=_factor_curves(long_replayed, short),
                                  call_graph_slowdown=per_call,
                                  measured=cal.measured + ("schedule_factor", "schedule_factor_curve",
                                                           "schedule_factor_curve_graphs")
                                  + (("call_graph_slowdown",) if per_call else ()))
    log.info("commopt tuner: calibrated %s x%d in %.1f s (%s)", name, world, time.perf_counter() - start,
             ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return cal


def _per_piece(hosts: dict[str, float], kind: str, world: int) -> float | None:
    """Host seconds per piece of `kind`'s GPU schedules: ce_push:4 against ce_push:1 where both
    were probed, else None."""
    if f"{kind} ce_push:1" not in hosts or f"{kind} ce_push:4" not in hosts:
        return None
    return max(0.0, (hosts[f"{kind} ce_push:4"] - hosts[f"{kind} ce_push:1"]) / (3 * max(1, world - 1)))


def _per_piece_by_kind(hosts: dict[str, float], world: int) -> dict[str, float]:
    """{kind: host seconds per piece} of the reductions probed at two piece counts.  A reduction's
    piece enqueues more than an all-gather's (its partial's push and flag, the received partial's
    copy, and for matmul_ar the reduced piece's pushes and copies): eager RS M_global 512
    ce_push:4 runs 0.40-0.52 ms a call slower than ce_push:1 (host-bound, 0.13-0.17 ms a piece)
    where the all-gather's figure charges 0.067, and AR 8192^3 ce_push:4 runs 1.23-1.28 ms eagerly
    (0.91 replayed) where max(device, host) with that figure predicts 1.01-1.03."""
    return {kind: pp for kind in ("matmul_rs", "matmul_ar") if (pp := _per_piece(hosts, kind, world)) is not None}


def _host_families(hosts: dict[str, float], world: int, per_piece: float,
                   by_kind: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """Host cost per schedule family ("ce_push") and per op and family ("matmul_rs ce_push"),
    and per piece, from the probes: a figure is its call's cost less the per-piece cost of its
    pieces (as the model adds them back: an op's own per-piece cost in `by_kind`, else the
    shared one); a family's is its first probe's.  The shared per-piece cost comes from the
    all-gather's ce_push:4 vs ce_push:1 where both were probed, else `per_piece`."""
    peers = max(1, world - 1)
    shared = _per_piece(hosts, "ag_matmul", world)
    per_piece = per_piece if shared is None else shared
    by_kind = by_kind or {}
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul.model import host_family

    out = {}
    for key, t in hosts.items():
        kind, sched = key.split(" ")
        parsed = Schedule.parse(sched)
        name = host_family(parsed)
        pieces = 1 if name in ("sequential", "local_first") else parsed.chunks * peers
        own = max(0.0, t - (0 if pieces == 1 else pieces * by_kind.get(kind, per_piece)))
        out.setdefault(name, own)
        out.setdefault(f"{kind} {name}", own)
    return out, per_piece


def calibrate_and_store(group_name: str, device: torch.device, cache_dir: str | None = None) -> Calibration:
    """Every rank: measure together; rank 0 of the group stores the result in the tuner cache
    under this machine's key, where `Config.mode="model"` finds it."""
    from torch_commopt.tuner.cache import TunerCache

    dtypes = ("float32",) if device.type == "cpu" else ("bfloat16", "float16", "float32")
    cal = measure(group_name, device, dtypes)
    if dist.get_rank() == dist.get_process_group_ranks(resolve_group(group_name))[0]:
        TunerCache(cache_dir).put(machine_key(device_name(device), cal.world), json.loads(cal.to_json()))
    return cal
