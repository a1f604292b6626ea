"""Choosing one region's schedule: the config's, the cost model's or autotune's (modes "model" and
"autotune"), or the built-in rule's (kernels/matmul/gpu/pick.py) with its host-bound band, which
rank 0 times at the first call; then the config's debug waits and per-call CUDA graphs, clamped
to the rows available.  The compile pass (pipeline.py) calls `schedule_for` per region, after
finding the regions and before checking that every rank chose alike.
"""

from __future__ import annotations

from torch_commopt import report as explain
from torch_commopt.config import Config
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.reference.chunking import chunk_rows
from torch_commopt.passes.graph_utils import static_shape, val
from torch_commopt.passes.regions import Region
from torch_commopt.tuner.matmul.model import RegionFacts


def band_pick(region: Region, facts: RegionFacts, band: list[str], rule_pick: Schedule, why: str, config: Config,
          report: explain.GraphReport) -> tuple[Schedule, str]:
    """A region in the rule's host-bound band (facts: the rule's inputs, rule_inputs): rank 0's
    cached measurement, or a placeholder that times `band` at the first call (the rule's pick
    runs under a CUDA-graph capture)."""
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.decide import decide
    from torch_commopt.tuner.machine import device_name
    from torch_commopt.tuner.matmul.autotune import TuneSite, band_key, band_request

    dev, replayed = device_name(val(region.a).device), replay_mode(region, config)
    key = band_key(facts, dev, band, replayed)
    what = ("replayed small all-reduce" if "oneshot" in band else "replayed short all-gather") if replayed \
        else "host-bound band"
    cache = TunerCache(config.cache_dir)
    cached = decide(region.group_name, key, lambda: cache.get(key), config.consistency_timeout_s)
    if isinstance(cached, dict) and cached.get("schedule") in band:
        return Schedule.parse(cached["schedule"]), why + f": {what}, cached measurement"
    site = TuneSite(region.group_name, config.cache_dir, region.collective.name, config.debug_waits, report.notes)
    sched = band_request(facts, dev, band, str(rule_pick), site, graphs=replayed)
    return sched, why + f": {what}, {', '.join(band)} timed at the first call ({rule_pick} under a capture)"


def takes_parts(region: Region, config: Config) -> bool:
    """Whether a reduction's op takes its concat-K matmul's terms as K parts (Config.k_parts:
    always, never, or "auto": where the parts move fewer bytes than the cats)."""
    from torch_commopt.passes.matmul.concat_k import operand_parts, parts_pay

    if region.kind == "ag_matmul" or not config.k_parts or region.consumers[0].scaled is not None:
        return False
    node = region.consumers[0].node
    return parts_pay(node) if config.k_parts == "auto" else operand_parts(node) is not None


def parts_of(region: Region, as_parts: bool) -> tuple[int, ...]:
    """The K of each product a reduction's op multiplies apart (concat-K's terms where the
    region takes them as parts, `takes_parts`; () : one)."""
    from torch_commopt.passes.matmul.concat_k import k_parts

    return k_parts(region.consumers[0].node) if as_parts else ()


def rule_picks_eager(config: Config) -> bool:
    """Whether the built-in rule picks the schedules (mode auto, no fixed schedule) of an
    eager program (no CUDA-graph trees): what the host-time estimates may decide."""
    return config.mode == "auto" and config.fixed_schedule is None and not config.cuda_graphs


def rule_inputs(region: Region, config: Config) -> tuple[list[int], list[list[int]], str, bool | str]:
    """(op A shape, weight shapes, dtype name, replayed) of a static region: what the built-in
    rule (kernels/matmul/gpu/pick.py) and its band take."""
    weights = [list(c.weight.meta["val"].shape) for c in region.consumers]
    return op_a_shape(region), weights, region_dtype(region), replay_mode(region, config)


def schedule_for(region: Region, config: Config, report: explain.GraphReport, host_ahead: bool = False) -> Schedule:
    """The schedule from Config, or the built-in rule ("auto"), clamped to the rows available.
    host_ahead: the graph's host runs ahead of its GPU (pipeline._host_ahead), so a region in the rule's
    host-bound band takes the rule's GPU-time pick instead of a first-call measurement."""
    name = region.collective.name
    wanted = config.fixed_schedule
    if wanted is not None and not wanted.valid_for(region.kind):
        report.notes.append(f"{name}: {region.kind} has no schedule {wanted.name!r}; using auto")
        wanted = None
    if region.dynamic:
        return _dynamic_schedule(region, wanted, config, report)
    if wanted is None and config.mode in ("model", "autotune"):
        wanted = _choose_by_model(region, config, report)
    if wanted is None:
        a = val(region.a)
        if a.device.type == "cuda":
            from torch_commopt.kernels.matmul.gpu.pick import measure_band, pick

            shape, weights, dtype, replayed = rule_inputs(region, config)
            band = measure_band(region.kind, shape, weights, region.dim, region.group_size, dtype, graphs=replayed)
            by_gpu_time = band is not None and host_ahead
            wanted, why = pick(region.kind, shape, weights, region.dim, region.group_size, dtype,
                               graphs=replayed or by_gpu_time)
            if by_gpu_time:
                why += ": host-bound band, but the graph's host runs ahead: ranked by GPU time"
            elif band is not None:
                facts = RegionFacts(region.kind, shape, weights, region.dim, region.group_size, dtype,
                                    k_parts=parts_of(region, takes_parts(region, config)))
                wanted, why = band_pick(region, facts, band, wanted, why, config, report)
            report.notes.append(f"{name}: picked {wanted} ({why})")
        else:
            wanted = Schedule("chunked", config.chunks)
    return finish(wanted, region, config, report)


def _dynamic_schedule(region: Region, wanted: Schedule | None, config: Config,
                      report: explain.GraphReport) -> Schedule:
    """A region with symbolic rows runs for every size the graph is called with: the schedule
    the config names (the ops cut any size into at most its pieces), else `auto`, the built-in
    rule applied per call shape (kernels.auto).  The cost model, autotune and the host-bound
    band's first-call timing need one shape, so they leave such regions to the rule."""
    name, rows = region.collective.name, region.summary()["a_shape"]
    if wanted is None and config.memory_budget_mib is not None:
        # a schedule's extra memory grows with the rows, unknown here: only the program's own
        # collective and matmul are sure to fit
        report.notes.append(f"{name}: rows {rows} are dynamic and a memory budget is set: kept as compiled")
        return Schedule("sequential")
    if wanted is None:
        wanted = Schedule("auto", config.chunks, (("graphs", 1),) if config.cuda_graphs else ())
        report.notes.append(f"{name}: rows {rows} are dynamic: {wanted}, the built-in rule per call shape"
                            + (f" (mode {config.mode!r} ranks one shape)" if config.mode in ("model", "autotune") else ""))
    if config.debug_waits and (wanted.is_gpu or wanted.name == "auto"):
        wanted = wanted.with_params(dbg=1)
    return wanted


def per_call_graphs(region: Region, config: Config) -> bool:
    """Whether the region's eager calls replay per-call CUDA graphs (Config.call_graphs: True,
    the host-bound band; "all", every region from the band's lower end up)."""
    if not config.call_graphs or config.cuda_graphs or region.dynamic:
        return False
    a = val(region.a)
    if a.device.type != "cuda":
        return False
    from torch_commopt.kernels.matmul.gpu.pick import call_graphs_pay

    weights = [list(c.weight.meta["val"].shape) for c in region.consumers]
    return call_graphs_pay(region.kind, op_a_shape(region), weights, region.group_size,
                           region_dtype(region), longer=config.call_graphs == "all")


def replay_mode(region: Region, config: Config) -> bool | str:
    """Whether the region's calls run replayed from CUDA graphs: True (the program's own) or
    PER_CALL (each eager call its own graph, truthy), else False.  Replayed, the rule and the
    cost model rank its schedules by GPU time alone; per call, the model adds the per-call
    replays' measured slowdown (Calibration.call_graph_slowdown)."""
    from torch_commopt.tuner.calibration import replayed_as

    return replayed_as(config.cuda_graphs, per_call_graphs(region, config))


def finish(wanted: Schedule, region: Region, config: Config, report: explain.GraphReport) -> Schedule:
    """The chosen schedule with the config's debug waits and per-call graphs, clamped to the
    rows available."""
    if config.debug_waits and wanted.is_gpu:
        wanted = wanted.with_params(dbg=1)
    if (wanted.is_gpu or wanted.name == "autotune") and per_call_graphs(region, config):
        wanted = wanted.with_params(cg=1)
    rows = _chunk_rows(region, wanted.chunks)
    chosen = wanted.clamp(rows)
    if chosen != wanted:
        report.notes.append(f"{region.collective.name}: {wanted} clamped to {chosen} "
                            f"(no row dim has more than {rows} rows)")
    return chosen


def op_a_shape(region: Region) -> list[int]:
    """The shape of the A operand the rewritten op receives: a reduction's A is replayed
    through the chain to the product's leading dims (rewrite.replay_chain), which is what
    its scatter dim counts in -- not the matmul's (often 2-D) input."""
    a = list(static_shape(region.a))
    if region.kind == "ag_matmul" or region.t_shape is None:
        return a
    return list(region.t_shape[:-1]) + [a[-1]]


def region_dtype(region: Region) -> str:
    """The dtype name of the region's A operand as its matmuls read it (float8 bytes gathered
    as uint8: the float8 type)."""
    return str(region.a_view or val(region.a).dtype).removeprefix("torch.")


def _choose_by_model(region: Region, config: Config, report: explain.GraphReport) -> Schedule:
    from torch_commopt.passes.matmul.concat_k import copy_bytes, kept_bytes
    from torch_commopt.reshard.plan import candidate_rows
    from torch_commopt.tuner.gemm_table import with_gemms
    from torch_commopt.tuner.machine import calibration_for, device_name
    from torch_commopt.tuner.matmul.autotune import plan

    a = val(region.a)
    cal = calibration_for(a.device, region.group_size, region.group_name, config.cache_dir, config.consistency_timeout_s)
    weights = [list(c.weight.meta["val"].shape) for c in region.consumers]
    as_parts = takes_parts(region, config)
    facts = RegionFacts(region.kind, op_a_shape(region), weights, region.dim, region.group_size, region_dtype(region),
                        bias=[c.bias is not None for c in region.consumers], reduce_op=region.reduce_op,
                        keep_gathered=region.keep_gathered,
                        copy_bytes=sum(copy_bytes(c.node, as_parts) for c in region.consumers),
                        kept_bytes=sum(kept_bytes(c.node) for c in region.consumers), k_parts=parts_of(region, as_parts))
    sched, preds, top, key, why = plan(
        facts, device_name(a.device), cal, _chunk_rows(region, 8), config.autotune_top_k, replay_mode(region, config),
        lambda shape, pool, graphs: with_gemms(cal, shape, pool, a.device, region.group_name, config.cache_dir,
                                               config.consistency_timeout_s, graphs=graphs))
    name = region.collective.name
    # a GPU works while the host enqueues: the whole-graph plan weighs both
    rows = candidate_rows(preds, device_split=cal.device != "cpu")
    report.candidates[name] = rows
    if config.mode == "autotune":
        sched, why = _autotune(region, config, sched, top, key, rows, report)
    report.notes.append(f"{name}: {config.mode} picked {sched} ({why})")
    return sched


def _autotune(region: Region, config: Config, model_pick: Schedule, top: list[str], key: dict, rows, report):
    """(schedule, why): rank 0's cached measurement of this region's candidates (from an
    earlier run or `python -m torch_commopt tune`), or an `autotune` placeholder that times
    them at the first call (tuner.autotune)."""
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.decide import decide
    from torch_commopt.tuner.matmul.autotune import MODEL_TIE, TuneRequest, register

    cache = TunerCache(config.cache_dir)
    cached = decide(region.group_name, key, lambda: cache.get(key), config.consistency_timeout_s)
    if isinstance(cached, dict) and cached.get("schedule") in top and isinstance(cached.get("measured_ms"), dict):
        for row in rows:
            row["measured_ms"] = cached["measured_ms"].get(row["schedule"])
        return Schedule.parse(cached["schedule"]), "cached measurement"
    request = TuneRequest(key, top, str(model_pick), region.group_name, config.cache_dir, config.debug_waits,
                          replay_mode(region, config), rows, report.notes, region.collective.name, tie=MODEL_TIE)
    return register(request), f"{len(top)} candidates timed at the first call; model's pick {model_pick}"


def _chunk_rows(region: Region, chunks: int) -> int:
    """Rows along the dim the reference's chunked schedule would cut (same rule as the op)."""
    return chunk_rows(region.kind, static_shape(region.a), region.t_shape, region.dim, region.group_size, chunks)
