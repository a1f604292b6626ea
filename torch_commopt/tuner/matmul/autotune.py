"""Config.mode = "autotune": the model's best candidates are timed on the real call, once.

At compile time the pass asks the tuner cache (rank 0's answer, through the c10d store) for
a region's measured winner.  On a miss it registers a `TuneRequest` and gives the region the
schedule `autotune:1:id=<digest of the request's key>`.  The first time the compiled program
calls that op, every rank of the group is in the same call (the op is collective and the
plan hash is checked at compile time), so every rank times the same candidates on the call's
own inputs, in the same order; each figure is the slowest rank's (all-reduce MAX), so all
ranks pick the same winner, and rank 0 stores it.  Later calls run the winner directly;
later compiles find it in the cache and emit it without an `autotune` placeholder.

Timing at the first call rather than inside the compile pass keeps collectives out of the
compiler (issuing them from the pass stalled gloo ranks intermittently under pytest) and
times the exact tensors the program uses.  Under CUDA-graph capture nothing is timed: the
model's choice runs (logged) and the measurement waits for an uncaptured call.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from torch_commopt.core.groups import resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu.call_graphs import capturing
from torch_commopt.kernels.matmul import ops
from torch_commopt.tuner.matmul.model import RegionFacts
from torch_commopt.tuner.matmul.rounds import Progress, paired_ms, round_order

log = logging.getLogger("torch_commopt.tuner.matmul.autotune")

ROUNDS = 5  # timing rounds; every candidate once per round, in an order ORDER sets
# The order of a round's candidates: "rotate" (the list rotated by the round's index: every
# candidate always follows the same one but at the wrap) or "shuffle" (a permutation drawn from
# the round's index, the same on every rank: each candidate follows each other one about as often).
ORDER = "rotate"
CLOSE, EXTRA_ROUNDS = 0.03, 10  # candidates within 3% of the best get 10 more rounds
# How a first call's timing is read (autotune, the band, the tune CLI): each candidate's median
# over its rounds (False), or the reference's median times the median of the candidate's ratio
# to it over the rounds timing both (True; paired_ms).  A power-capped card's clocks drop within a
# measurement, and the near-tie rounds come last, so medians compare the near-ties' slow samples
# with the others' fast ones (clocks falling ~9% from the 5th round on let a schedule win by its
# early samples that runs 9.3% slower head to head).  The paired read's picks are a measured
# best on more shapes and its worst pick is closer to the best (docs/tuner.md, "Autotune:
# measurement at the first call").
PAIRED = True
TARGET_S = {"cuda": 5e-3, "cpu": 20e-3}  # back-to-back calls per sample last at least this
# Before a candidate's calls per sample are sized, it runs WARMUP_CALLS untimed calls: first-use
# costs (buffers, streams, kernels) and, for a schedule replayed from per-call graphs (cg=1),
# both buffer halves' captures (each at its second sighting: calls 3 and 4) stay out of it.  The
# size comes from the fastest of SIZING_CALLS single calls: sized from a call that still pays a
# first-use cost, every sample of a candidate holds a call or two, so each carries the barrier
# and synchronize around it (tens of us) and the candidate is measured slow throughout (with
# per-call graphs, AG M_global 2048: the schedule timed first reads ~20% slow, so par=1 /
# ce_push:1 reads 1.26 or 0.85 instead of ~0.98).
# A schedule whose first two calls each last a sample's TARGET_S on every rank (no per-call graphs
# there; one call a sample) stops there, agreed: every call is collective.  Decided per rank, a
# measurement can hang: a rank whose second call waits on its peer's first use is long where the
# peer's is not, so one rank stops, the other makes another collective call, and they never
# match again.
WARMUP_CALLS, SIZING_CALLS = 4, 3
# A band region (host-bound eager calls, pick.measure_band) leaves NCCL + cuBLAS only for a
# schedule measured this much faster: there the host's speed moves a GPU schedule's time
# between rounds (ar ce_push:1 at M_global 2048 runs 0.31-0.58 ms, NCCL 0.32-0.33),
# and a first-call measurement that caught the fast rounds must not make the program lose.
BAND_MARGIN = 0.05
# ... and only for a schedule whose host enqueue time, this many times over, still fits in
# `sequential`'s time: a band call runs at max(GPU, host), and the host slows 1.5-9x in bursts
# (RS M_global 2048 ce_push:1 enqueues ~185 us a call against NCCL's ~287 us of GPU time: ahead
# on the median round, level on the mean), so a first call's measurement that saw the fast host
# can pick a schedule that then runs 0.72x NCCL.  NCCL's own enqueue is 55-75 us.
BAND_HOST_HEADROOM = 1.5
# A replayed band region (a short all-gather replayed from CUDA graphs) has no host in its
# calls: its candidates differ by GPU time alone, and replays time within ~2% (under BAND_MARGIN
# a short all-gather's gemm=whole, ~4-7% faster than NCCL, would stay on NCCL).
REPLAYED_BAND_MARGIN = 0.02
# The band's measurement runs more rounds than autotune's, and its host check takes each
# candidate's fastest round: a host burst at the first call otherwise decides for the whole run
# (a burst that doubles ce_push:1's enqueue at RS M_global 2048 keeps NCCL, where ce_push:1
# runs at 0.86x the best baseline's time).  The headroom factor stays for the slower hosts of
# later calls; more rounds spread the timed calls over ~0.2 s instead of ~0.07.
BAND_ROUNDS = 15
# The model ranks, measurement confirms: autotune runs the model's pick unless another candidate
# is measured faster by more than MODEL_TIE (a fraction).  Two measurements of one pair seconds
# apart differ by ~1-2%, so below that a measured order is the measurement's, and the model's
# order is the better guess.  Scored offline on 602 tuner-sweep shapes (both cards, each pick
# judged on its sweep's head-to-head): a measured best 574 times with no tie, 578 with 0.5%,
# 581 with 1%, 574 with 1.5%, 565 with 2% (docs/tuner.md, "Measurements behind the constants").
MODEL_TIE = 0.01


@dataclass
class TuneRequest:
    """One region waiting for its first call."""

    key: dict[str, Any]
    candidates: list[str]
    fallback: str  # the model's choice, run where nothing can be timed
    group_name: str
    cache_dir: str | None
    debug_waits: bool = False
    graphs: bool = False  # time replays of CUDA graphs (Config.cuda_graphs)
    report_rows: list[dict[str, Any]] = field(default_factory=list)  # explain's candidate rows
    report_notes: list[str] = field(default_factory=list)
    name: str = ""
    decided: str | None = None
    measured: dict[str, float] = field(default_factory=dict)
    margin: float = 0.0  # another schedule must beat `sequential` by this fraction to be run
    headroom: float = 0.0  # ... and enqueue in 1/headroom of `sequential`'s time (0: no check)
    host: dict[str, float] = field(default_factory=dict)  # enqueue ms per call, fastest round (the check's)
    rounds: int = ROUNDS  # timing rounds of the first call
    tie: float = 0.0  # the model's pick (fallback) stays unless another is measured faster by this (winner)


_REQUESTS: dict[str, TuneRequest] = {}
_warned: set[str] = set()


def read_key() -> dict[str, str]:
    """The part of a measured decision's cache key that names how its timing was read: a
    decision read another way (medians: PAIRED off) is measured again, not reused."""
    return {"read": "paired"} if PAIRED else {}


def plan(facts: RegionFacts, device_name: str, cal, max_chunks: int, top_k: int, graphs: bool = False, gemms=None):
    """(model's pick, ranked predictions, candidates to time, cache key) of a region: the one
    definition the compile pass and `python -m torch_commopt tune` share, so a prefilled
    cache answers the pass.  graphs=True: for a program replayed from CUDA graphs (its own
    ranking, timing and cache entry).  facts.copy_bytes, kept_bytes: not in the key (the timed
    calls start from the copied operands, whichever candidate runs); facts.k_parts: the K of
    each product the op multiplies apart (in the key: the calls differ); gemms: choose_by_model's."""
    from torch_commopt.tuner.machine import machine_key
    from torch_commopt.tuner.matmul.choose import choose_by_model

    pick, preds, why = choose_by_model(facts, cal, max_chunks, graphs=graphs, gemms=gemms)
    top = timed_candidates(preds, top_k)
    key = {"question": "autotune", **machine_key(device_name, facts.world), "kind": facts.kind,
           "a_shape": list(facts.a_shape), "weights": [list(w) for w in facts.weight_shapes], "dim": facts.dim,
           "bias": list(facts.bias), "reduce_op": facts.reduce_op, "keep_gathered": facts.keep_gathered,
           "dtype": facts.dtype, "candidates": top, **read_key(), "model_tie": MODEL_TIE}
    if graphs:
        key["cuda_graphs"] = True
    if facts.k_parts:
        key["k_parts"] = list(facts.k_parts)
    return pick, preds, top, key, why


def timed_candidates(preds, top_k: int) -> list[str]:
    """What autotune times for ranked predictions: the top_k, every other piece count of each
    schedule family among them, and `sequential`.  Piece counts of one mechanism are
    near-ties the model cannot order reliably (AR 8192^3 runs best with ce_push:4 and RS
    16384x8192x8192 with ce_push:2 where the model ranks ce_push:1 first and neither sibling
    among its top 4; RS 16384x8192x7168 runs best with direct:2, a sibling of its fourth)."""
    top = [str(p.schedule) for p in preds[:top_k]]
    families = {(p.schedule.name, p.schedule.params) for p in preds[:top_k]}
    for p in preds:
        s = str(p.schedule)
        if ((p.schedule.name, p.schedule.params) in families or p.schedule.name == "sequential") and s not in top:
            top.append(s)
    return top


@dataclass(frozen=True)
class TuneSite:
    """Where a region's first-call measurement runs and reports: its group (by name), the
    tuner cache rank 0 stores the winner in, the region's name in logs, whether the winner runs
    with debug waits, and explain's notes (a list the request appends to; None: its own)."""

    group_name: str
    cache_dir: str | None
    name: str = ""
    debug_waits: bool = False
    notes: list[str] | None = None


def band_request(facts: RegionFacts, device_name: str, candidates: list[str], fallback: str, site: TuneSite, *,
                 graphs: bool = False) -> Schedule:
    """The placeholder of a region the built-in rule leaves to measurement (pick.measure_band):
    `candidates` are timed at its first call like Config.mode="autotune" (`fallback` runs
    where nothing can be timed, e.g. under a CUDA-graph capture).  graphs: the region's calls
    are replayed from CUDA graphs, and so are the timed ones (by GPU time: no host check)."""
    key = band_key(facts, device_name, candidates, graphs)
    return register(TuneRequest(key, list(candidates), fallback, site.group_name, site.cache_dir,
                                debug_waits=site.debug_waits, graphs=graphs,
                                report_notes=site.notes if site.notes is not None else [], name=site.name,
                                margin=REPLAYED_BAND_MARGIN if graphs else BAND_MARGIN,
                                headroom=0.0 if graphs else BAND_HOST_HEADROOM,
                                rounds=BAND_ROUNDS))


def band_key(facts: RegionFacts, device_name: str, candidates: list[str], graphs: bool = False) -> dict[str, Any]:
    """The tuner-cache key of a band region's measurement (band_request; facts.k_parts: as plan's;
    bias, reduce_op and the copies are not in it)."""
    from torch_commopt.tuner.machine import machine_key

    key = {"question": "rule band", **machine_key(device_name, facts.world), "kind": facts.kind,
           "a_shape": list(facts.a_shape), "weights": [list(w) for w in facts.weight_shapes], "dim": facts.dim,
           "dtype": facts.dtype, "candidates": list(candidates),
           "host_headroom": BAND_HOST_HEADROOM,  # decisions made under another check are not reused
           "host_check": "fastest round", "rounds": BAND_ROUNDS, "margin": BAND_MARGIN, **read_key()}
    if facts.k_parts:
        key["k_parts"] = list(facts.k_parts)
    if graphs:  # timed as replays, no host check
        key.update(graphs=True, host_headroom=0.0, margin=REPLAYED_BAND_MARGIN)
    return key


def decided(schedule: Schedule) -> str | None:
    """What an `autotune` placeholder resolved to (None before its first call)."""
    req = _REQUESTS.get(schedule.param("id"))
    return req.decided if req is not None else None


def measurement(schedule: Schedule) -> dict[str, float]:
    """{candidate: ms} an `autotune` placeholder's first call measured ({} before it)."""
    req = _REQUESTS.get(schedule.param("id"))
    return dict(req.measured) if req is not None else {}


def host_measurement(schedule: Schedule) -> dict[str, float]:
    """{candidate: host enqueue ms per call} of that first call ({} before it)."""
    req = _REQUESTS.get(schedule.param("id"))
    return dict(req.host) if req is not None else {}


def digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def register(request: TuneRequest) -> Schedule:
    """The placeholder schedule the rewritten op carries until its first call.  Regions
    with the same key (identical layers, a recompile) share one request and one timing."""
    token = digest(request.key)
    known = _REQUESTS.setdefault(token, request)
    if known is not request:
        known.report_rows += request.report_rows
        if known.decided is not None:
            for row in request.report_rows:
                row["measured_ms"] = known.measured.get(row["schedule"])
    return Schedule("autotune", 1, (("id", token),))


def resolve_at_call(schedule: Schedule, run: Callable[[str], Any], device: torch.device) -> str:
    """The schedule string this call of an `autotune` op runs (timing the candidates first
    if this is the region's first call)."""
    token = schedule.param("id")
    req = _REQUESTS.get(token)
    if req is None:
        if token not in _warned:
            _warned.add(token)
            log.warning("commopt autotune: no request %s in this process (a graph compiled elsewhere?); "
                        "running sequential", token)
        return "sequential"
    if req.decided is not None:
        return req.decided
    if device.type == "cuda" and capturing():
        if token not in _warned:
            _warned.add(token)
            log.warning("commopt autotune: %s is called under CUDA-graph capture; running the model's %s untimed",
                        req.name, req.fallback)
        return req.fallback
    start = time.perf_counter()
    host: dict[str, float] = {}

    def measure() -> dict[str, float]:
        timing = Timing(graphs=req.graphs, rounds=req.rounds)
        return measure_candidates(run, req.candidates, req.group_name, device, req.name, timing=timing,
                                  readings=Readings(host_floor=host))
    try:
        if req.graphs and device.type == "cuda":
            # A replayed program's first call runs in Inductor's CUDA-graph-tree warm-up, whose pool
            # takes the calling thread's allocations and refuses tensors left alive there
            # ("Detected 1 tensor(s) in the cudagraph pool not tracked as outputs"); a helper
            # thread allocates from the ordinary pool (symm.off_thread, as the rendezvous).
            # Its stream is not the caller's: the inputs must be complete first.
            # (tests/gpu: test_short_all_gather_under_cuda_graph_trees.)
            from torch_commopt.kernels.gpu.symm import off_thread

            torch.cuda.synchronize(device)
            measured = off_thread(measure, device)
        else:
            measured = measure()
    except NothingCaptured:  # e.g. a first call inside another capture's warm-up: every rank is here
        log.warning("commopt autotune: %s: no candidate could be captured for timing; running %s untimed",
                    req.name, req.fallback)
        req.decided = req.fallback
        req.report_notes.append(f"{req.name}: no candidate could be captured for timing; runs {req.fallback} untimed")
        return req.decided
    best = winner(measured, req.margin, host if req.headroom else None, req.headroom, prior=req.fallback, tie=req.tie)
    sched = Schedule.parse(best)
    if req.debug_waits and sched.is_gpu:
        sched = sched.with_params(dbg=1)
    req.decided, req.measured, req.host = str(sched), measured, host
    group = resolve_group(req.group_name)
    if dist.get_rank() == dist.get_process_group_ranks(group)[0]:
        from torch_commopt.tuner.cache import TunerCache

        TunerCache(req.cache_dir).put(req.key, {"schedule": best, "measured_ms": measured, "host_ms": host})
    for row in req.report_rows:
        row["measured_ms"] = measured.get(row["schedule"])
    req.report_notes.append(f"{req.name}: autotune measured {len(measured)} candidates at the first call in "
                            f"{time.perf_counter() - start:.2f} s; runs {req.decided} ({measured[best]:.3f} ms)"
                            + (f"; host enqueue ms (fastest round) {_rounded(host)}" if req.headroom else ""))
    log.info("commopt autotune: %s -> %s %s (host %s)", req.name, req.decided, _rounded(measured), _rounded(host))
    return req.decided


def _rounded(figures: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in figures.items()}


def winner(measured: dict[str, float], margin: float = 0.0, host: dict[str, float] | None = None,
           headroom: float = 0.0, prior: str | None = None, tie: float = 0.0) -> str:
    """The fastest candidate; `sequential` unless another is faster by `margin` (a fraction)
    and, given `host` (enqueue ms per call), enqueues within 1/headroom of sequential's time
    (a slower host would otherwise make it lose); the fastest such candidate else.  prior (the
    model's pick) stands for the fastest where it is measured within `tie` (a fraction, > 0) of it."""
    seq = measured.get("sequential")
    eligible = dict(measured)
    if seq is not None and host is not None and headroom > 0:
        for s in [s for s in eligible if s != "sequential" and host.get(s, math.inf) * headroom > seq]:
            log.info("commopt autotune: %s enqueues %.3f ms a call, over 1/%.1f of sequential's %.3f ms: not run",
                     s, host.get(s, math.inf), headroom, seq)
            del eligible[s]
    best = min(eligible, key=lambda s: (eligible[s], s))
    if tie > 0 and prior in eligible and prior != best and eligible[prior] <= eligible[best] * (1.0 + tie):
        log.info("commopt autotune: the model's %s (%.4f ms) is within %.1f%% of %s (%.4f ms): %s runs",
                 prior, eligible[prior], tie * 100, best, eligible[best], prior)
        best = prior
    if seq is not None and best != "sequential" and eligible[best] > seq * (1.0 - margin):
        log.info("commopt autotune: %s (%.3f ms) is within %.0f%% of sequential (%.3f ms): sequential runs",
                 best, eligible[best], margin * 100, seq)
        return "sequential"
    return best


@dataclass(kw_only=True, frozen=True)
class Timing:
    """How measure_candidates times its candidates.

    graphs: (CUDA) each sample is one replay of a CUDA graph holding the back-to-back calls
        (what a program replayed from graphs sees); a candidate whose capture fails on any
        rank is left out.
    rounds: timing rounds before the near-tie ones.
    paired: each figure is the round-paired estimate of `paired_ms` instead of the median (the
        near-ties chosen so too); None: as PAIRED, the tuner's read.
    order: each round's order, "rotate" or "shuffle" (round_order); None: as ORDER.
    """

    graphs: bool = False
    rounds: int = ROUNDS
    paired: bool | None = None
    order: str | None = None


@dataclass(kw_only=True, frozen=True)
class Readings:
    """What measure_candidates reports beside its figures, each into the container given
    (None: not kept).

    host: {schedule: ms per call the host spent enqueueing}, measured as the figures are (the
        device idle at each sample's start), median over rounds, slowest rank.
    host_floor: the same, fastest round (slowest rank's).
    trace: (round, schedule, ms per call) of every sample, the slowest rank's.
    """

    host: dict[str, float] | None = None
    host_floor: dict[str, float] | None = None
    trace: list[tuple[int, str, float]] | None = None


def measure_candidates(run: Callable[[str], Any], candidates: list[str], group_name: str,
                       device: torch.device, label: str = "", *, timing: Timing = Timing(),
                       readings: Readings = Readings()) -> dict[str, float]:
    """{schedule: ms per call} of back-to-back calls (the host cost included: that is what
    the program will see), over rounds (read as timing.paired says), slowest rank.  Every rank
    must call this with the same candidates at the same point of its program.  timing: how
    (Timing); readings: what else to report, and where (Readings)."""
    graphs, rounds, paired, order = timing.graphs, timing.rounds, timing.paired, timing.order
    host, host_floor, trace = readings.host, readings.host_floor, readings.trace
    group = resolve_group(group_name)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
    counts = [_calls_per_sample(run, s, sync, group, device) for s in candidates]
    n = torch.tensor(counts, dtype=torch.float64, device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
    counts = [int(c) for c in n.tolist()]
    calls = [functools.partial(_repeat, run, s, c) for s, c in zip(candidates, counts)]
    if graphs and device.type == "cuda":
        replays = capture_agreed({s: call for s, call in zip(candidates, calls)}, group)
        if not replays:  # agreed: every rank raises
            raise NothingCaptured("commopt autotune: no candidate could be captured in a CUDA graph")
        keep = [i for i, s in enumerate(candidates) if s in replays]
        candidates, calls, counts = [candidates[i] for i in keep], list(replays.values()), [counts[i] for i in keep]
    samples: list[list[float]] = [[] for _ in candidates]
    enqueued: list[list[float]] = [[] for _ in candidates]
    taken: list[tuple[int, int]] = []  # (round, candidate index) of every sample, in the order timed
    # The group's first rank reports; a bar only on global rank 0: with several groups tuning
    # at once (each TP group of a DP x TP mesh) their bars would overwrite each other on the
    # launcher's one terminal, so the others log their progress at INFO.
    show = dist.get_rank() == dist.get_process_group_ranks(group)[0]
    bar_here = dist.get_rank() == 0

    def timed_rounds(indices: list[int], count: int, desc: str) -> list[float]:
        """Time the candidates `indices` for `count` rounds (order rotated per round); the
        medians of all samples so far, slowest rank's."""
        bar = Progress(count * len(indices), f"commopt autotune {label} {desc}".rstrip(), show, bar_here)
        first_round = 1 + max((r for r, _ in taken), default=-1)
        for r in range(count):
            for i in round_order(indices, r, order or ORDER, first_round):
                taken.append((first_round + r, i))
                bar.step(candidates[i])
                dist.barrier(group=group)
                sync()
                t0 = time.perf_counter()
                calls[i]()
                enqueued[i].append((time.perf_counter() - t0) / counts[i] * 1e3)
                sync()
                samples[i].append((time.perf_counter() - t0) / counts[i] * 1e3)
        bar.close()
        t = torch.tensor([statistics.median(v) for v in samples] + [statistics.median(v) for v in enqueued]
                         + [min(v) for v in enqueued], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        figures, n = t.tolist(), len(candidates)
        if host is not None:
            host.update((candidates[i], figures[n + i]) for i in indices)
        if host_floor is not None:
            host_floor.update((candidates[i], figures[2 * n + i]) for i in indices)
        return figures[:n]

    reduced: list[tuple[int, str, float]] = []  # slowest_rows' last answer

    def slowest_rows() -> list[tuple[int, str, float]]:
        """Every sample so far as (round, schedule, ms), the slowest rank's: every rank took the
        same samples in the same order (reduced again only after new samples)."""
        if len(reduced) == len(taken):
            return reduced
        position = [0] * len(candidates)
        flat = []
        for _, i in taken:
            flat.append(samples[i][position[i]])
            position[i] += 1
        t = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        reduced[:] = [(r, candidates[i], ms) for (r, i), ms in zip(taken, t.tolist())]
        return reduced

    paired = PAIRED if paired is None else paired
    figures = dict(zip(candidates, timed_rounds(list(range(len(candidates))), rounds, "")))
    if paired:
        figures = paired_ms(slowest_rows(), min(figures, key=lambda s: (figures[s], s)))
    # Near-ties get more rounds: two figures within the run-to-run spread swap places between
    # measurements.  Every rank holds the same figures, so all agree on the extra work.
    ref = min(figures, key=lambda s: (figures[s], s))
    close = [i for i, s in enumerate(candidates) if figures[s] <= figures[ref] * (1 + CLOSE)]
    if len(close) > 1:
        figures = dict(zip(candidates, timed_rounds(close, EXTRA_ROUNDS, "(near-tie)")))
        if paired:  # against the first rounds' best, which ran in every round
            figures = paired_ms(slowest_rows(), ref)
    if trace is not None:
        trace.extend(slowest_rows())  # the rows a paired read just reduced, or reduced now
    return figures


def _calls_per_sample(run: Callable[[str], Any], schedule: str, sync: Callable[[], None], group,
                      device: torch.device) -> int:
    """Back-to-back calls of `schedule` that last TARGET_S, this rank's figure: WARMUP_CALLS
    untimed calls, then the fastest of SIZING_CALLS single calls (two calls in all where both
    last TARGET_S on every rank: every call is collective, so every rank makes as many)."""
    target, single = TARGET_S[device.type], []  # every call's seconds: the warm-ups, then the sizing calls
    for i in range(WARMUP_CALLS + SIZING_CALLS):
        sync()
        t0 = time.perf_counter()
        run(schedule)
        sync()
        single.append(time.perf_counter() - t0)
        if i == 1 and _all_ranks(min(single) >= target, group, device):
            break
    sizing = single[WARMUP_CALLS:] or single[-2:]
    return max(1, min(200, math.ceil(target / max(min(sizing), 1e-6))))


def _all_ranks(flag: bool, group, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the group (a collective)."""
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


class NothingCaptured(RuntimeError):
    """No candidate of a replayed measurement could be captured, on any rank (capture_agreed)."""


def _repeat(run: Callable[[str], Any], schedule: str, count: int) -> None:
    for _ in range(count):
        run(schedule)


def capture_agreed(calls: dict[str, Callable[[], Any]], group=None) -> dict[str, Callable[[], None]]:
    """{name: replay of a CUDA graph holding what calls[name]() does}, in the order of
    `calls`; a call whose capture fails on any rank is left out on every rank (its graph may
    hold collectives the others would not join)."""
    graphs, ok = [], []
    for name, call in calls.items():
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                call()
            ok.append(1)
        except Exception as e:  # noqa: BLE001 - logged; the call is dropped on every rank
            log.warning("commopt: %s could not be captured in a CUDA graph (%s: %s); left out", name, type(e).__name__, e)
            ok.append(0)
        graphs.append(graph)
    agreed = torch.tensor(ok, device=torch.cuda.current_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return {name: graph.replay for name, graph, good in zip(calls, graphs, agreed.tolist()) if good}


def _first_call(schedule: Schedule, run: Callable[[str], Any], device: torch.device) -> tuple[str, bool]:
    picked = resolve_at_call(schedule, run, device)
    return picked, decided(schedule) is not None


ops.register_first_call_tuner(_first_call)
