"""The schedule probes of a calibration: each schedule family timed on probe shapes, and the
factors the model applies to that family (measured / predicted), eager, replayed from CUDA
graphs and with per-call graphs.

calibrate.measure runs them after the links, GEMM fit and host costs are measured: a family's
factor corrects what the pipeline model (tuner/matmul/model.py) misses of it on this machine.
"""

from __future__ import annotations

import functools
import logging
import statistics

import torch

from torch_commopt.kernels.matmul.ops import runner
from torch_commopt.tuner.calibration import Calibration

log = logging.getLogger("torch_commopt.tuner.probe_factors")

# Probe shapes of the schedule families (local A, weight), unlike the benchmark sweep's:
# M_global 12288, K 6144, N 6144 at two ranks (long enough that the device, not the host,
# bounds back-to-back calls).
PROBE_SHAPES = {"ag_matmul": ((6144, 6144), (6144, 3072)), "matmul_rs": ((12288, 3072), (3072, 6144)),
                "matmul_ar": ((12288, 3072), (3072, 6144))}
# Short probes (M_global 3072, K = N = 6144 at two ranks), timed as CUDA-graph replays (device
# time: an eager call this short is host-bound): the second point of each family's factor.
SHORT_PROBE_SHAPES = {"ag_matmul": ((1536, 6144), (6144, 3072)), "matmul_rs": ((3072, 3072), (3072, 6144)),
                      "matmul_ar": ((3072, 3072), (3072, 6144))}
FACTOR_RANGE = (0.5, 3.0)  # measured / predicted outside this is a measurement problem
# An eager probe within this of its calls' host figure is host-bound: its device time is hidden
# under the host's, so it gives no factor.  Judged by the measured time, not by the model's
# uncorrected device time, which the factor exists to correct: judged by the model, a host
# figure read high (RS `fused` at 412-493 us a call against 302-395 usually) drops the
# device-bound RS `fused:2` probe (~1.05 ms) as host-bound, and `fused` (no replayed probe: a
# capture runs it as ce_push) keeps factor 1, is predicted 30% fast and is picked where it runs
# 30-38% slower than the best.  The margin covers the host figure's run-to-run spread.
HOST_BOUND = 1.2
# The first of a family stands for it; the piece counts after it get factors of their own
# (a family factor can rank rs direct:2 first where it runs ~8% slower than direct:1;
# ce_push:1 reductions add the partial after the own GEMM, a different pipeline).
PROBE_SCHEDULES = {"ag_matmul": ("sequential", "local_first", "chunked:2", "ce_push:2", "fused:1", "ce_push:1",
                                 "ce_push:4", "fused:4", "ce_push:1:gemm=whole", "fused:1:tma=1", "ce_push:1:par=1",
                                 "fused:1:impl=sm90"),
                   "matmul_rs": ("sequential", "chunked:2", "ce_push:2", "ce_pull:2", "direct:1", "fused:2",
                                 "ce_push:1", "ce_push:4", "direct:2", "fused:2:tma=1", "fused:1:impl=sm90"),
                   "matmul_ar": ("sequential", "chunked:2", "ce_push:2", "ce_pull:2", "direct:1", "ce_push:1",
                                 "ce_push:4", "direct:2")}


# How the schedule probes are read: each schedule's own median (False), or round-paired
# (rounds.paired_ms).  A probe times ten or eleven schedules in one measurement, so the drift
# that can make medians pick a slower schedule (see autotune.PAIRED) reaches the
# probes' near-ties and, through them, the factors; the paired read is not yet measured against
# the model's figures (bench_costmodel.py --probes-paired is the A/B).  A calibration is cached:
# a changed read needs a fresh cache directory.
PROBES_PAIRED = False


def _schedule_probes(group_name: str, world: int, device: torch.device, shapes=PROBE_SHAPES,
                     graphs: bool = False, call_graphs: bool = False) -> dict[str, float]:
    """{"kind schedule": seconds per call} of one schedule per family on a probe shape:
    back-to-back calls as a program makes them (tuner.autotune's timing, slowest rank);
    graphs=True: replays of CUDA graphs (device time), without the schedules that run as
    another one inside a capture; call_graphs=True: back-to-back eager calls that each replay
    their own graph (cg=1, Config.call_graphs), GPU schedules that a capture takes only."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul.autotune import Timing, measure_candidates

    out = {}
    for kind, (a_shape, w_shape) in shapes.items():
        a = torch.randn(a_shape, device=device, dtype=torch.bfloat16)
        w = torch.randn(w_shape, device=device, dtype=torch.bfloat16) / w_shape[0] ** 0.5
        scheds = [s for s in PROBE_SCHEDULES[kind] if _probed(kind, Schedule.parse(s), graphs, call_graphs)]
        run = _probe_runner(kind, a, w, world, group_name)
        if call_graphs:  # the same calls, each with cg=1
            run = functools.partial(_with_per_call_graph, run, kind)
        ms = measure_candidates(run, scheds, group_name, device, timing=Timing(graphs=graphs, paired=PROBES_PAIRED))
        out.update({f"{kind} {s}": t / 1e3 for s, t in ms.items()})
    return out


def _probe_runner(kind: str, a: torch.Tensor, w: torch.Tensor, world: int, group_name: str):
    """runner(kind, a, [w], ...), except that the sm_90a kernels' schedules (impl=sm90) get the
    same weight K-major, nn.Linear's layout and the one they take: given w's, they would run the
    Triton kernel under their name."""
    plain = runner(kind, a, [w], world, group_name)
    kmajor = runner(kind, a, [w.t().contiguous().t()], world, group_name)
    return lambda s: (kmajor if "impl=sm90" in s else plain)(s)


def _probed(kind: str, sched, graphs: bool, call_graphs: bool) -> bool:
    """Whether a probe set times `sched`: replayed, only what a capture takes as it is; with
    per-call graphs, only such GPU schedules."""
    if not (graphs or call_graphs):
        return True
    return sched.in_capture(kind) == sched and (sched.is_gpu or not call_graphs)


def _with_per_call_graph(run, kind: str, sched: str):
    """run(sched) with cg=1: the call replays its own CUDA graph (captured at its second sighting)."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.kernels.gpu.call_graphs import per_call

    return run(str(per_call(kind, Schedule.parse(sched))))


# Per-call over whole-graph replays outside this is a broken probe, not a slowdown: on the
# sweeps' band shapes every GPU schedule runs per call at 0.94-1.28x its replayed time, while a
# probe that reads 1.9-2.2x (a host-bound eager call's figure) would rank the schedules it
# leaves out ahead of the ones it measured.
CALL_GRAPH_SLOWDOWN_RANGE = (0.9, 1.4)
LAST_PER_CALL_STATS: dict[str, int] = {}  # the last per-call probes' calls: eager, captured, replayed, dropped


def _per_call_probes(group_name: str, world: int, device: torch.device) -> dict[str, float]:
    """The short probes with per-call graphs (_schedule_probes(call_graphs=True)), {} where
    they are switched off (kernels.gpu.call_graphs.ENV).  The graphs they capture are dropped
    after, unless the process had some of its own before."""
    from torch_commopt.kernels.gpu import call_graphs

    LAST_PER_CALL_STATS.clear()
    if not call_graphs.enabled_by_env():
        return {}
    stats = call_graphs.stats()
    fresh, before = not stats, _call_graph_counts(stats)
    try:
        return _schedule_probes(group_name, world, device, SHORT_PROBE_SHAPES, call_graphs=True)
    except Exception as e:  # noqa: BLE001 - the same code fails alike on every rank: calibrate without them
        log.warning("commopt calibrate: per-call graph probes failed (%s: %s); per-call regions are ranked "
                    "as replayed", type(e).__name__, e)
        return {}
    finally:
        after = _call_graph_counts(call_graphs.stats())
        LAST_PER_CALL_STATS.update({k: after.get(k, 0) - before.get(k, 0) for k in after})
        log.info("commopt calibrate: per-call graph probes: %s", LAST_PER_CALL_STATS)
        if fresh:
            call_graphs.reset()


def _call_graph_counts(stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """call_graphs.stats() summed over devices and streams."""
    out: dict[str, int] = {}
    for counts in stats.values():
        for k, v in counts.items():
            out[k] = out.get(k, 0) + v
    return out


def _call_graph_slowdown(per_call: dict[str, float], replayed: dict[str, float]) -> dict[str, float]:
    """{"kind family:S", "kind family" (its first probe) and "kind" (the median of its probes)}:
    each probe's time with per-call graphs over its time replayed from one graph, both on
    SHORT_PROBE_SHAPES; a probe outside CALL_GRAPH_SLOWDOWN_RANGE is left out (logged), and its
    schedule then takes its family's or its op's figure (Calibration.factor), not none at all."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul.model import factor_key

    out: dict[str, float] = {}
    by_kind: dict[str, list[float]] = {}
    for key, seconds in per_call.items():
        if replayed.get(key, 0) <= 0:
            continue
        ratio = seconds / replayed[key]
        if not CALL_GRAPH_SLOWDOWN_RANGE[0] <= ratio <= CALL_GRAPH_SLOWDOWN_RANGE[1]:
            log.warning("commopt calibrate: %s per-call graphs %.3f ms vs %.3f ms replayed; left out",
                        key, seconds * 1e3, replayed[key] * 1e3)
            continue
        kind, sched = key.split(" ")
        parsed = Schedule.parse(sched)
        out.setdefault(f"{kind} {parsed.name}", ratio)
        out[factor_key(kind, parsed)] = ratio
        by_kind.setdefault(kind, []).append(ratio)
    out.update({kind: statistics.median(ratios) for kind, ratios in by_kind.items()})
    return out


def _schedule_factors(probes: dict[str, float], cal: Calibration, shapes=PROBE_SHAPES,
                      graphs: bool = False) -> dict[str, tuple[float, float]]:
    """{"kind family": (predicted device s, measured / predicted)} of each probed family (the
    rest of `cal` measured); a family whose eager probe measured host-bound (HOST_BOUND), or whose
    ratio is outside FACTOR_RANGE (a broken probe, not a model correction), is left out."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul.model import RegionShape, factor_key, predict

    out = {}
    for key, seconds in probes.items():
        kind, sched = key.split(" ")
        (rows, k), (_, n) = shapes[kind]
        pred = predict(RegionShape(kind, rows, k, (n,), cal.world, "bfloat16"), Schedule.parse(sched), cal, graphs=graphs)
        if not graphs and seconds <= pred.host_s * HOST_BOUND:
            log.info("commopt calibrate: %s measured %.3f ms, host-bound (host %.3f ms): no factor from it",
                     key, seconds * 1e3, pred.host_s * 1e3)
            continue
        factor = seconds / pred.gpu_s
        if not FACTOR_RANGE[0] <= factor <= FACTOR_RANGE[1]:
            log.warning("commopt calibrate: %s measured %.3f ms vs %.3f ms predicted; factor left at 1",
                        key, seconds * 1e3, pred.gpu_s * 1e3)
            continue
        parsed = Schedule.parse(sched)
        out.setdefault(f"{kind} {parsed.name}", (pred.gpu_s, factor))  # the family's first probe
        out[factor_key(kind, parsed)] = (pred.gpu_s, factor)
    return out


def _unmeasured_families(probed: list[str], eager: dict[str, float], replayed: dict[str, tuple[float, float]]
                         ) -> dict[str, float]:
    """{"kind family": factor} for each family probed (`probed`: "kind schedule" keys) that got no
    factor either way -- its eager probe host-bound or out of range, and no replayed probe (a
    fused reduction: a capture runs it as ce_push): its op's median factor, logged.  Left at 1,
    such a family is priced at the raw model, which under-predicts every GPU family by 5-45% on
    the probes (an RS `fused` left at 1 is predicted 30% fast and picked, 30-38% slower than the best)."""
    from torch_commopt.core.schedule import Schedule

    out = {}
    for key in probed:
        kind, sched = key.split(" ")
        family = f"{kind} {Schedule.parse(sched).name}"
        if family in eager or family in replayed or family in out:
            continue
        own = [f for k, f in eager.items() if k.startswith(kind + " ") and ":" not in k.split(" ")[1]]
        if own:
            out[family] = statistics.median(own)
            log.warning("commopt calibrate: %s got no factor from its probes; it takes its op's median, %.3f",
                        family, out[family])
    return out


def _probe_gemm_keys(cal: Calibration) -> list[str]:
    """The GEMMs (Calibration.gemm_table keys) the model prices for the schedule probes, long
    and short, eager and replayed: the same list on every rank."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul.model import RegionShape, gemm_keys

    keys: set[str] = set()
    for shapes in (PROBE_SHAPES, SHORT_PROBE_SHAPES):
        for kind, ((rows, k), (_, n)) in shapes.items():
            shape = RegionShape(kind, rows, k, (n,), cal.world, "bfloat16")
            for graphs in (False, True):
                keys.update(gemm_keys(shape, cal, [Schedule.parse(s) for s in PROBE_SCHEDULES[kind]], graphs=graphs))
    return sorted(keys)


def _eager_over_replayed(long: dict[str, tuple[float, float]], replayed: dict[str, tuple[float, float]]) -> float:
    """The median over the schedules timed both ways on the long probe shape of their eager time
    over their replayed time (Calibration.eager_over_replayed); 0 where none was."""
    ratios = [long[k][0] * long[k][1] / (replayed[k][0] * replayed[k][1])
              for k in long if ":" in k.split(" ")[1] and k in replayed and replayed[k][0] * replayed[k][1] > 0]
    return statistics.median(ratios) if ratios else 0.0


def _factor_curves(long: dict[str, tuple[float, float]], short: dict[str, tuple[float, float]]) -> dict:
    """The families with both points, as Calibration.schedule_factor_curve."""
    return {key: sorted([list(long[key]), list(short[key])]) for key in long if key in short}
