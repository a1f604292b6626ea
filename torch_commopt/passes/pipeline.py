"""The commopt post-grad pass: find regions -> choose schedules (choose.py) -> check ranks -> rewrite.

Runs on every post-grad graph Inductor compiles (forward, backward, inference) because
the backend hands it to `compile_fx` through `config_patches`.  Finders run in the
documented order of FINDERS and each can be disabled by name (Config.patterns).
"""

from __future__ import annotations

import functools
import logging
import pathlib
from collections import Counter

import torch
from torch.fx import Graph

from torch_commopt import report as explain
from torch_commopt.config import Config
from torch_commopt.core import consistency
from torch_commopt.core.groups import group_role, resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.passes import choose
from torch_commopt.passes.graph_utils import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    DYNAMIC_SHAPE,
    REDUCE_SCATTER,
    Unsupported,
    group_name_of,
    val,
)
from torch_commopt.passes.matmul.find_ag_matmul import find_ag_matmul
from torch_commopt.passes.matmul.find_matmul_reduce import find_matmul_reduce
from torch_commopt.passes.matmul.gemm_2d import Region2D, find_gemm_2d, pick_slices, rewrite_gemm_2d, schedule_2d
from torch_commopt.passes.matmul.rewrite import rewrite_region
from torch_commopt.passes.regions import Region
from torch_commopt.report import Skip

try:  # torch >= 2.10 tells inference-aware passes which graph they see
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
except ImportError:  # pragma: no cover - older torch
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
from torch._inductor.custom_graph_pass import get_hash_for_files

log = logging.getLogger("torch_commopt.passes.pipeline")

# (pattern name, finder) in the order they run: an all-gather region claims its matmuls
# before a reduction region could claim the same matmul.
FINDERS = (
    ("ag_matmul", lambda g, cfg: find_ag_matmul(g)),
    ("matmul_rs", lambda g, cfg: find_matmul_reduce(g, ("matmul_rs",))),
    ("matmul_ar", lambda g, cfg: find_matmul_reduce(g, ("matmul_ar",))),
)

KEPT = "kept (sequential: the graph's own collective + matmul)"
_COLLECTIVES = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce",
                ALL_TO_ALL: "all_to_all"}


class CommoptPass(_PassBase):
    """Inductor custom post-grad pass; `uuid` covers the package source and the config,
    so Inductor's caches never mix graphs rewritten under different code or options."""

    def __init__(self, config: Config):
        self.config = config

    def __call__(self, graph: Graph, is_inference: bool | None = None) -> None:
        run_commopt_pass(graph, self.config, is_inference=is_inference)

    def uuid(self) -> str:
        files = tuple(sorted(str(p) for p in pathlib.Path(__file__).parents[1].rglob("*.py")))
        return get_hash_for_files(files, self.config.to_json()).hex()


def run_commopt_pass(graph: Graph, config: Config, *, is_inference: bool | None = None) -> explain.GraphReport:
    report = explain.GraphReport(
        graph_id=explain.next_graph_id(),
        graph_kind=_graph_kind(graph, is_inference),
        compile_id=_compile_id(),
        collectives_before=_count_collectives(graph),
    )
    from torch_commopt.passes.joint import PENDING_NOTES

    report.notes += PENDING_NOTES  # the joint-graph pass of this compile (training graphs)
    PENDING_NOTES.clear()
    if config.concat_k and ("matmul_rs" in config.patterns or "matmul_ar" in config.patterns):
        from torch_commopt.passes.matmul.concat_k import concat_k

        _graph_rewrite("concat-K", lambda: concat_k(graph), report)
    if config.coconet:
        from torch_commopt.passes.matmul.coconet import reorder_all_gathers

        _graph_rewrite("CoCoNet reorder", lambda: reorder_all_gathers(graph), report)
    if config.ar_split:
        from torch_commopt.passes.matmul.ar_split import split_all_reduces

        decide = None if config.ar_split_policy == "always" else _split_decider(graph, config, report)
        _graph_rewrite("all-reduce split", lambda: split_all_reduces(graph, check=config.ar_split == "checked",
                                                                     decide=decide), report)
    if "ag_matmul" in config.patterns:
        from torch_commopt.passes.matmul.b_gather import transpose_b_gathers

        _graph_rewrite("B-side gathers", lambda: transpose_b_gathers(graph), report)
    if "attention" in config.patterns:
        from torch_commopt.passes.attention.rewrite import rewrite_attention

        timeout = config.consistency_timeout_s if config.check_rank_consistency else None
        _graph_rewrite("attention rewrite", lambda: rewrite_attention(
            graph, inference=report.graph_kind == "inference", schedule=config.attention_schedule,
            consistency_timeout_s=timeout, cache_dir=config.cache_dir, mode=config.mode, top_k=config.autotune_top_k,
            tune_timeout_s=config.consistency_timeout_s), report)
    if "moe" in config.patterns:
        from torch_commopt.passes.moe.apply import rewrite_capacity_moe

        timeout = config.consistency_timeout_s if config.check_rank_consistency else None
        _graph_rewrite("moe rewrite", lambda: rewrite_capacity_moe(graph, config.moe_schedule, timeout,
                                                                   config.cache_dir, report.skipped), report)
    try:
        from torch_commopt.passes.matmul.ar_split import find_ar_splits

        # analysis only (reshard issue): where CoCoNet's all-reduce split could apply
        report.notes += [f"split candidate: {c.describe()}" for c in find_ar_splits(graph)]
    except Exception as e:  # an explain note at most: never in the way of a compile
        log.debug("commopt: all-reduce split analysis failed: %s", e)
    try:
        regions2d = _find_2d(graph, config, report)
        regions = _find_regions(graph, config, report, {r.mm for r, *_ in regions2d})
        if regions and _left_host_bound(graph, regions, config, report):
            regions = []
        edges = _region_edges(regions, config)
        report.edges = [e.describe(regions) for e in edges]
        ahead = _host_ahead(graph, regions, config, report)
        schedules = [choose.schedule_for(r, config, report, ahead) for r in regions]
        key = "predicted_ms"
        if regions and (config.mode == "model" or config.memory_budget_mib is not None):
            schedules, key = _fit_graph(regions, schedules, config, report)
        report.plan = _plan_view(regions, schedules, config, report, key, edges)
    except Exception as e:  # analysis only: the graph is still untouched, so leave it so
        log.exception("commopt: analysis of graph %d failed; graph left untouched", report.graph_id)
        report.notes.append(f"NOT rewritten: analysis failed ({type(e).__name__}: {e})")
        regions, schedules, regions2d = [], [], []
    decisions = [_decision(r, s) for r, s in zip(regions, schedules)] + [_decision_2d(r, s, a) for r, s, a in regions2d]
    report.plan_hash = consistency.plan_hash(decisions)
    if (regions or regions2d) and not _ranks_agree(graph, regions, decisions, report, config, regions2d):
        regions, schedules, regions2d = [], [], []
    replaced, rewritten = {}, 0
    for region, slices, axis in regions2d:
        rewrite_gemm_2d(graph, region, slices, axis)
        rewritten += 1
        report.regions.append(explain.RegionReport(region.kind, region.mm.name, region.summary(),
                                                   schedule_2d(slices, region.dataflow, axis), "rewritten"))
    for region, schedule in zip(regions, schedules):
        if _keep_as_compiled(region, schedule, config):
            report.regions.append(explain.RegionReport(
                region.kind, region.collective.name, region.summary(), str(schedule), KEPT))
            continue
        rewrite_region(graph, region, schedule, replaced, k_parts=choose.takes_parts(region, config))
        rewritten += 1
        report.regions.append(explain.RegionReport(
            region.kind, region.collective.name, region.summary(), str(schedule), "rewritten"))
    if config.concat_k:
        from torch_commopt.passes.matmul.concat_k import undo_unclaimed

        _graph_rewrite("concat-K undo", lambda: undo_unclaimed(graph), report)
    if rewritten:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        graph.lint()
    report.collectives_after = _count_collectives(graph)
    report.commopt_ops = dict(Counter(n.target._opname for n in graph.nodes if _is_commopt(n)))
    if config.debug:
        report.code = graph.python_code("self").src
    explain.record(report)
    return report


def _graph_rewrite(what: str, apply, report: explain.GraphReport) -> None:
    """Run a CoCoNet rewrite (its notes go to explain).  Each step edits the graph only after
    its checks and fake values are done, so a failure leaves no step half done: the steps
    already made stand, the rest are skipped, logged."""
    try:
        report.notes += apply()
    except Unsupported as e:  # a form the rewrite does not take (e.g. dynamic sizes): a note, no trace
        log.info("commopt: %s stopped on graph %d: %s", what, report.graph_id, e)
        report.notes.append(f"{what} stopped ({e})")
    except Exception as e:
        log.exception("commopt: %s stopped on graph %d", what, report.graph_id)
        report.notes.append(f"{what} stopped ({type(e).__name__}: {e})")


def _keep_as_compiled(region: Region, schedule: Schedule, config: Config) -> bool:
    """A region whose *chosen* schedule is `sequential` keeps the graph's own collective and
    matmul: that is the sequential schedule, with no op of ours in between (no host cost on
    short calls, nothing to trust).  A schedule the user fixed is applied as asked."""
    fixed = config.fixed_schedule
    return schedule.name == "sequential" and not (fixed is not None and fixed.valid_for(region.kind))


def _find_2d(graph: Graph, config: Config, report: explain.GraphReport) -> list[tuple[Region2D, int, str]]:
    """The graph's 2D GEMMs (passes/matmul/gemm_2d.py), each with its slice count (the
    config's, or the cost model's, noted with its estimates) and per-axis schedule (`_axis`)."""
    if "gemm_2d" not in config.patterns:
        return []
    found, skipped = find_gemm_2d(graph)
    report.skipped += skipped
    out = []
    for region in found:
        if config.mesh2d_slices == 0 and region.keep_gathered:
            slices = 1
            report.notes.append(f"gemm_2d {region.mm.name}: S = 1, not SUMMA (Config.mesh2d_slices = 0): the "
                                "program keeps the gathered operand, which SUMMA's broadcasts never assemble")
        elif config.mesh2d_slices is not None:
            slices = config.mesh2d_slices
            report.notes.append(f"gemm_2d {region.mm.name}: S = {slices} (Config.mesh2d_slices)")
        else:
            slices, times = pick_slices(region)
            est = ", ".join(f"S={s} {t * 1e3:.3f} ms" for s, t in sorted(times.items()))
            report.notes.append(f"gemm_2d {region.mm.name}: MeshSlice {region.dataflow} on {region.rows}x{region.cols}, "
                                f"picked S = {slices} (model: {est})")
        out.append((region, slices, _axis(region, slices, config, report)))
    return out


def _axis(region: Region2D, slices: int, config: Config, report: explain.GraphReport) -> str:
    """Config.mesh2d_axis_schedule where the region can take it (ls and rs, sliced or
    Collective), else "" with the reason noted."""
    from torch_commopt.kernels.mesh2d.ops import axis_schedule_error

    axis = config.mesh2d_axis_schedule
    why = axis_schedule_error(region.dataflow, slices, axis)
    if why is not None:
        report.notes.append(f"gemm_2d {region.mm.name}: c10d's collectives, not {axis} per axis ({why})")
        return ""
    return axis


def _find_regions(graph: Graph, config: Config, report: explain.GraphReport, taken=frozenset()) -> list[Region]:
    """The 1-D regions of the graph's collectives (`taken`: matmuls a 2D region holds already)."""
    regions, claimed = [], set(taken)
    for name, finder in FINDERS:
        if name not in config.patterns:
            continue
        found, skipped = finder(graph, config)
        report.skipped += skipped
        for region in found:
            mms = {c.node for c in region.consumers}
            if mms & claimed:
                report.skipped.append(Skip(name, region.collective.name, "its matmul already belongs to another region"))
                continue
            claimed |= mms
            regions.append(region)
    for s in report.skipped:
        log.info("commopt left %s at %s untouched: %s", s.kind, s.node, s.reason)
    dynamic = [s for s in report.skipped if DYNAMIC_SHAPE in s.reason]
    if dynamic and not _warned["dynamic"]:
        _warned["dynamic"] = True  # once a process: every recompiled graph would repeat it
        log.warning("commopt: %d collective(s) left untouched in a graph compiled with dynamic shapes (%s); "
                    "torch.compile recompiles with dynamic sizes when an input's shape changes (e.g. a short "
                    "last batch), and later steps may run that graph. Matmul regions with dynamic rows are "
                    "rewritten (schedule auto), these are not: to keep their overlap, compile with "
                    "dynamic=False or keep the shapes fixed (drop_last=True)", len(dynamic), dynamic[0].reason)
    return regions


_warned = {"dynamic": False}


def _host_ahead(graph: Graph, regions: list[Region], config: Config, report: explain.GraphReport) -> bool:
    """Whether the built-in rule may rank this graph's band regions by GPU time
    (passes/host_ahead.py): only where the rule picks (mode auto, no fixed schedule) on CUDA
    eager calls, with a static region in the band."""
    if not config.band_in_graph or not choose.rule_picks_eager(config):
        return False
    from torch_commopt.kernels.matmul.gpu.pick import measure_band

    def in_band(r: Region) -> bool:
        if r.dynamic or val(r.a).device.type != "cuda":
            return False
        shape, weights, dtype, replayed = choose.rule_inputs(r, config)
        return measure_band(r.kind, shape, weights, r.dim, r.group_size, dtype, graphs=replayed) is not None

    if not any(in_band(r) for r in regions):
        return False
    from torch_commopt.passes.host_ahead import host_runs_ahead

    with_backward = config.band_in_graph == "training" and report.graph_kind == "forward"
    ahead, note = host_runs_ahead(graph, len(regions), with_backward)
    report.notes.append(note)
    return ahead


def _left_host_bound(graph: Graph, regions: list[Region], config: Config, report: explain.GraphReport) -> bool:
    """Config.host_bound_graphs="inductor": whether this graph is left to Inductor because its
    host is estimated not to run ahead of its GPU (the rule's eager CUDA programs only)."""
    if config.host_bound_graphs != "inductor" or not choose.rule_picks_eager(config) \
            or any(r.dynamic or val(r.a).device.type != "cuda" for r in regions):
        return False
    from torch_commopt.passes.host_ahead import estimate, figures

    gpu, host, launches = estimate(graph, len(regions))
    if host <= gpu:
        return False
    report.notes.append(figures(gpu, host, launches, len(regions))
                        + ": host-bound, left to Inductor (Config.host_bound_graphs='inductor')")
    return True


def _region_edges(regions: list[Region], config: Config) -> list:
    """The region DAG, its reshards priced with this machine's calibration in modes that use
    one (else the priors).  Analysis only: a failure here costs the view, nothing else."""
    from torch_commopt.passes.dag import region_edges
    from torch_commopt.tuner.machine import calibration_for

    if not regions:
        return []
    try:
        cal = None
        if config.mode in ("model", "autotune"):
            r = regions[0]
            cal = calibration_for(val(r.a).device, r.group_size, r.group_name, config.cache_dir,
                                  config.consistency_timeout_s)
        return region_edges(regions, cal=cal)
    except Exception as e:  # noqa: BLE001 - informational
        log.warning("commopt: region DAG not derived (%s: %s)", type(e).__name__, e)
        return []


def _plan_view(regions: list[Region], schedules: list[Schedule], config: Config,
               report: explain.GraphReport, key: str = "predicted_ms", edges=()) -> list[str]:
    """explain's whole-graph plan (analysis only: a failure here costs the view, nothing else):
    the regions' totals and runner-up (reshard.plan.describe_plan), then the reshards on the
    edges between regions and the graph's total."""
    if config.mode not in ("model", "autotune") or not regions:
        return []
    from torch_commopt.reshard.plan import describe_edges, describe_plan

    static = [(r.collective.name, s) for r, s in zip(regions, schedules) if not r.dynamic]
    names = [n for n, _ in static]
    if not names or any(n not in report.candidates for n in names):
        return []
    try:
        chosen = {n: str(s.without_debug()) for n, s in static}
        cands = {n: report.candidates[n] for n in names}
        return describe_plan(cands, chosen, config.memory_budget_mib, key) + describe_edges(edges, cands, chosen, key)
    except Exception as e:  # noqa: BLE001 - informational
        log.warning("commopt: plan view not derived (%s: %s)", type(e).__name__, e)
        return []


def _fit_graph(regions: list[Region], schedules: list[Schedule], config: Config,
               report: explain.GraphReport) -> tuple[list[Schedule], str]:
    """Re-choose every region's schedule jointly: mode "model" by the whole graph's time
    (reshard.plan.choose_for_graph), within Config.memory_budget_mib where one is given.
    Returns the schedules and the candidate-row key the plan was chosen by."""
    from torch_commopt.reshard.plan import choose_for_graph, choose_within_budget

    names = [r.collective.name for r in regions if not r.dynamic]  # dynamic ones pick per call
    if not names:
        return schedules, "predicted_ms"
    if any(n not in report.candidates for n in names):
        report.notes.append("whole-graph plan not applied: a region has no ranked candidates")
        return schedules, "predicted_ms"
    cands = {n: report.candidates[n] for n in names}
    if config.mode == "model":
        choice, note, key = choose_for_graph(cands, config.memory_budget_mib)
    else:
        (choice, note), key = choose_within_budget(cands, config.memory_budget_mib), "predicted_ms"
    report.notes.append(note)
    out = []
    for region, old in zip(regions, schedules):
        name = region.collective.name
        if region.dynamic:
            out.append(old)
            continue
        new = choose.finish(Schedule.parse(cands[name][choice[name]]["schedule"]), region, config, report)
        if new != old:
            report.notes.append(f"{name}: {new} instead of {old} (whole-graph plan)")
        out.append(new)
    return out, key


def _split_decider(graph: Graph, config: Config, report: explain.GraphReport):
    """ar_split_policy="cost": the graph's split candidates decided together (reshard.split_plan:
    exact, with the residual gathers a split neighbour removes on the edges between them); a
    candidate the joint plan does not cover (one the splits before it created) or a plan that
    cannot be made falls back to deciding that candidate alone (_split_pays)."""
    from torch_commopt.passes.matmul.ar_split import find_ar_splits
    from torch_commopt.passes.matmul.split_plan import plan_splits

    alone = functools.partial(_split_pays, config)
    try:
        cands = [c for c in find_ar_splits(graph) if c.from_matmul and c.feeds_matmul]
        if len(cands) < 2 or len({group_name_of(c.all_reduce.args[2]) for c in cands}) != 1:
            return alone
        plan = plan_splits(cands, *_split_machine(cands[0], config))
    except Exception as e:  # noqa: BLE001 - each candidate is then decided alone
        report.notes.append(f"all-reduce split: no joint plan ({type(e).__name__}: {e}); candidates decided alone")
        return alone

    def decide(cand) -> tuple[bool, str]:
        if cand.all_reduce in plan.split:
            return plan.split[cand.all_reduce], plan.why[cand.all_reduce]
        return alone(cand)

    return decide


def _split_machine(cand, config: Config):
    """(group size, calibration) of a split candidate's all-reduce group (rank 0's calibration,
    so every rank decides alike)."""
    from torch_commopt.tuner.machine import calibration_for

    group_name = group_name_of(cand.all_reduce.args[2])
    world = resolve_group(group_name).size()
    return world, calibration_for(val(cand.all_reduce.args[0]).device, world, group_name, config.cache_dir,
                                  config.consistency_timeout_s)


def _split_pays(config: Config, cand) -> tuple[bool, str]:
    """Config.ar_split_policy="cost": whether the cost model predicts the split faster (the
    same answer on every rank: identical shapes, rank 0's calibration).  A candidate that
    cannot be costed is kept as it is."""
    from torch_commopt.passes.matmul.ar_split import split_shapes
    from torch_commopt.reshard.ar_cost import split_cost

    try:
        world, cal = _split_machine(cand, config)
        cost = split_cost(split_shapes(cand, world), cal)
    except Exception as e:  # noqa: BLE001 - a decision we cannot make is "keep the all-reduce"
        return False, f"not costed: {type(e).__name__}: {e}"
    return cost.pays, cost.describe()


def _ranks_agree(graph: Graph, regions: list[Region], decisions: list[dict], report: explain.GraphReport,
                 config: Config, regions2d=()) -> bool:
    if not config.check_rank_consistency:
        report.notes.append("rank consistency check disabled by config")
        return True
    reason = consistency.check_skipped_reason()
    if reason is not None:
        report.notes.append(f"rank consistency check skipped: {reason}")
        return True
    # The identity is the original graph's collectives with the plan: a rank compiling the same
    # graph again on its own (a guard that failed on it alone) finds the outcome and follows it.
    # Each group compares them with every other group rendered as its role (group_role): on a
    # 2D mesh the ranks of one row sit in different columns' groups, whose names differ.  (Groups
    # are visited in name order, the same on every rank: no two ranks wait on each other in turn.)
    what = f"plan of graph {report.graph_id} ({report.graph_kind})"
    signature = _collective_signature(graph)
    groups = {r.group_name for r in regions} | {g for r, *_ in regions2d for g in (r.rows_group, r.cols_group)}
    for name in sorted(groups):
        seen = functools.partial(_as_seen_by, name)
        sig = [(target, args[:-1] + [seen(args[-1])] if named else args, shape)
               for target, args, named, shape in signature]
        plan = [dict(d, **{k: seen(d[k]) for k in ("group", "group2") if k in d}) for d in decisions]
        value = f"{consistency.digest(sig)}:{consistency.plan_hash(plan)}"
        decision = consistency.Decision("plan", name, consistency.digest([value]), what)
        outcome = consistency.agree(decision, value, config.consistency_timeout_s)
        if not outcome.agreed:
            log.error("commopt: graph %d left untouched on every rank: %s", report.graph_id, outcome.detail)
            report.notes.append(f"NOT rewritten: {outcome.detail}")
            report.skipped += [Skip(r.kind, r.collective.name, "rank consistency check failed") for r in regions]
            report.skipped += [Skip(r.kind, r.mm.name, "rank consistency check failed") for r, *_ in regions2d]
            return False
    return True


def _decision(region: Region, schedule: Schedule) -> dict:
    """What a rank's collectives depend on; node names and the rest of the graph do not count
    (Inductor's own passes may name or shape unrelated nodes differently on different ranks)."""
    summary = region.summary()
    summary.pop("matmuls")
    summary.pop("collective")
    return dict(summary, schedule=str(schedule))


def _decision_2d(region: Region2D, slices: int, axis: str = "") -> dict:
    """A 2D GEMM's decision as _decision's: its groups (rendered by role for the other groups), shapes
    and schedule (the per-axis one included)."""
    summary = region.summary()
    summary.pop("matmul")
    groups = summary.pop("groups")
    return dict(summary, group=groups["rows"], group2=groups["cols"],
                schedule=schedule_2d(slices, region.dataflow, axis))


def _collective_signature(graph: Graph) -> list:
    """The graph's collectives in program order: (target, its int and str arguments, whether the
    last of them is the group's name -- funcol's last argument --, the input's shape)."""
    sig = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target in _COLLECTIVES:
            args = [a for a in n.args[1:] if isinstance(a, (int, str))]
            sig.append((str(n.target), args, bool(args) and isinstance(n.args[-1], str),
                        str(getattr(val(n.args[0]), "shape", None))))
    return sig


def _as_seen_by(voting: str, name: str) -> str:
    """Group `name` as the ranks of group `voting` compare it: itself by name, any other by its role."""
    return name if name == voting else group_role(name)


def _graph_kind(graph: Graph, is_inference: bool | None) -> str:
    if is_inference:
        return "inference"
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    if is_inference is False or any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"


def _compile_id() -> str | None:
    cid = torch._guards.CompileContext.current_compile_id()
    return None if cid is None else str(cid)


def _is_commopt(node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == "commopt"


def _count_collectives(graph: Graph) -> dict[str, int]:
    return dict(Counter(_COLLECTIVES[n.target] for n in graph.nodes
                        if n.op == "call_function" and n.target in _COLLECTIVES))
