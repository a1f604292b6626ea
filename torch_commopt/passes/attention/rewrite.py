"""Rewrite the context-parallel attention detect.py finds (the pass pipeline's attention step).

Inference graphs (no backward): an `allgather_kv` region -- K and V all-gathered along the
sequence into SDPA with the rank's local queries -- becomes one `commopt.cp_attention_fwd`
on the local q, k, v (k and v taken before their gathers, brought to (B, H_kv, S_loc, D) by
the same layout ops with the sequence cut by W), running the schedule the attention cost
model ranks first (or Config.attention_schedule); the gathers are dropped.  The op's output
replaces the attention's; a region whose other outputs (the LSE, philox state) are used is
left alone.

A `decode_kv` region (a few queries against K and V gathered along the sequence: decoding over
a sequence-sharded cache) becomes one `commopt.decode_attention` on the queries and the rank's
share of K and V, its mask cut to the rank's columns (shard_rows): the ranks all-gather partial
outputs and LSEs of a few KB instead of the cache.

A `ulysses` region (all-to-all -> attention -> all-to-all, operands in the program's own
layout) becomes cp_attention_fwd too, on the rank's q, k, v before their all-to-alls brought
to the op's layout, its output brought to the one the output all-to-all delivered
(ulysses.py; the relayouts come from the layout algebra, layout.py); the four all-to-alls go.

Training graphs are rewritten before they get here, on the joint graph (passes/attention/joint.py:
the backward expects what the forward saves, so both halves change together); a region still
found in a post-grad training graph is one the joint rewrite did not take, and is reported
(the joint rewrite takes all-gather and Ulysses regions whose backward is the exact mirror).
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import Graph, Node

from torch_commopt.core.attention_spec import refusal
from torch_commopt.kernels.attention import schedules
from torch_commopt.passes.attention import cplib, ulysses
from torch_commopt.passes.attention.detect import AttentionRegion, _map_dim, find_attention
from torch_commopt.passes.chains import add_node
from torch_commopt.passes.graph_utils import Unsupported, aten, static_shape, val
from torch_commopt.tuner.attention.cost import machine_for, rank_schedules

log = logging.getLogger("torch_commopt.passes.attention.rewrite")

KEEP_ULYSSES = "ulysses"  # a flex_ulysses region's choice to keep the program's own all-to-alls
RESIZE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}


def rewrite_attention(graph: Graph, *, inference: bool, schedule: str = "auto",
                      consistency_timeout_s: float | None = None, cache_dir: str | None = None,
                      mode: str = "auto", top_k: int = 4, tune_timeout_s: float = 300.0) -> list[str]:
    """Find the graph's context-parallel attention; rewrite it where it can run as
    cp_attention_fwd (inference graphs).  One explain note per region and per skip.
    consistency_timeout_s: check the decisions across ranks first (None: no check); mode,
    top_k: Config.mode and autotune_top_k (_choose); tune_timeout_s: how long a rank waits for
    rank 0's calibration or cached answer."""
    cplib.expand(graph)  # torch context_parallel's K/V gather op, as the collectives it runs
    regions, skips = find_attention(graph)
    notes = [f"attention {s.node}: left alone ({s.reason})" for s in skips]
    plans: dict[int, ulysses.UlyssesPlan] = {}
    reasons = {id(r): _why_kept(r, inference, plans) or _flex_kept(r) for r in regions}
    choices = {id(r): _choose(r, schedule, cache_dir, tune_timeout_s, mode=mode, top_k=top_k)
               for r in regions if reasons[id(r)] is None}
    if inference:
        disagree = ranks_disagree(regions, skips, choices, consistency_timeout_s)
        if disagree:
            return notes + [disagree]
    for region in regions:
        what = describe(region)
        if reasons[id(region)] is not None:
            notes.append(f"{what}: {reasons[id(region)]}")
            continue
        chosen, _, why = choices[id(region)]
        if region.form == "decode_kv":
            _apply_decode(graph, region)
            notes.append(f"{what}: decode_attention ({why})")
            continue
        if region.form == "flex_allgather_kv":
            _apply_flex(graph, region, chosen)
            notes.append(f"{what}: cp_flex_attention_fwd {chosen} ({why})")
            continue
        if region.form == "flex_ulysses":
            if chosen == KEEP_ULYSSES:
                notes.append(f"{what}: kept, the program's Ulysses ({why})")
            else:
                _apply_ulysses(graph, region, plans[id(region)], chosen)
                notes.append(f"{what}: cp_flex_attention_fwd {chosen} ({why})")
            continue
        if region.form == "ulysses":
            _apply_ulysses(graph, region, plans[id(region)], chosen)
        else:
            _apply(graph, region, chosen)
        notes.append(f"{what}: cp_attention_fwd {chosen} ({why})")
    for note in notes:
        log.info("commopt: %s", note)
    return notes


def describe(region: AttentionRegion) -> str:
    return f"attention {region.attention.name} ({region.form}, shape {tuple(region.shape)}, W={region.world})"


def _shown(ranked: list[tuple[str, float]]) -> str:
    return ", ".join(f"{n} {ms:.3f} ms" for n, ms in ranked[:4])


def _flex_kept(region: AttentionRegion) -> str | None:
    """Why a flex region stays as the program runs it: its log-sum-exp used by the program (our
    schedules give it only to their own backward)."""
    if region.flex is None:
        return None
    if region.flex.lse is not None and not _only_backward_reads(region.flex.lse):
        return "not rewritten (the program uses flex_attention's log-sum-exp)"
    return None


def _only_backward_reads(lse: Node) -> bool:
    """Whether the LSE output only reaches flex_attention_backward (through detaches): a joint graph's."""
    from torch_commopt.passes.attention.detect import FLEX_BACKWARD

    todo, seen = list(lse.users), set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is FLEX_BACKWARD:
            continue
        if node.target is not aten.detach.default:
            return False
        todo += list(node.users)
    return True


def _why_kept(region: AttentionRegion, inference: bool, plans: dict) -> str | None:
    """Why the post-grad rewrite leaves a region as it is (None: it rewrites it; a Ulysses
    region's relayouts go to `plans`)."""
    if not inference:
        return "found in a training graph and left as it is (the joint-graph rewrite did not take it; see its note)"
    why = _unsupported(region)
    if why is None and region.form in ("ulysses", "flex_ulysses"):
        try:
            plans[id(region)] = ulysses.plan(region)
        except Unsupported as e:
            why = str(e)
    return f"not rewritten ({why})" if why else None


def ranks_disagree(regions: list[AttentionRegion], skips: list, choices: dict, timeout_s: float | None) -> str | None:
    """Why the attention rewrite must not run on this graph: the ranks' decisions differ
    (a rank that rewrites while another keeps the gathers deadlocks both).  A mask is
    evaluated per rank, so the decision can differ by rank.  choices: id(region) -> (schedule,
    ranking) of the regions this rank would rewrite.  None: they agree (or no check)."""
    from torch_commopt.core import consistency

    if timeout_s is None or not (regions or skips) or consistency.check_skipped_reason() is not None:
        return None
    import torch.distributed as dist

    decisions = [("skip",) for _ in skips] + [
        (r.form, tuple(r.shape), r.causal, r.world, choices[id(r)][0] if id(r) in choices else "kept")
        for r in regions]
    world = dist.distributed_c10d._get_default_group().group_name
    value = consistency.digest(sorted(map(str, decisions)))
    decision = consistency.Decision("attention", world, consistency.digest([value]), "attention rewrite")
    outcome = consistency.agree(decision, value, timeout_s)
    return None if outcome.agreed else f"attention NOT rewritten on any rank: {outcome.detail}"


def _unsupported(region: AttentionRegion) -> str | None:
    node = region.attention
    if node.target is not aten.scaled_dot_product_attention.default:
        used = {u.args[1] for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.users}
        if used - {0}:
            return f"outputs {sorted(used - {0})} of {node.target.__name__} are used"
    if any(not isinstance(val(n), torch.Tensor) for n in region.inputs.values()):
        return "an operand has no recorded value"
    return None


def _choose(region: AttentionRegion, schedule: str, cache_dir: str | None = None,
            timeout_s: float = 300.0, *, backward: bool = False, mode: str = "auto",
            top_k: int = 4, kept_gathers: bool = False) -> tuple[str, list[tuple[str, float]], str]:
    """(schedule, ranked predictions, why, for explain): the named one (checked); else with
    mode="autotune" rank 0's cached measurement of this shape (tuner/attention/tune.py) where there is
    one; else the attention model's first with the machine's tuner calibration (rank 0's; else
    the priors).  backward: rank and measure forward + backward (a training graph runs both),
    else the forward.  kept_gathers: flex's one-group all-gather will keep its gathered K/V."""
    if region.form == "decode_kv":  # one schedule: the partials merged by their LSE
        return "lse_merge", [], ("each rank attends over its share of the cache; the partial outputs and LSEs are "
                                 "all-gathered and merged, instead of the cache")
    if region.flex is not None:
        return _choose_flex(region, schedule, cache_dir, timeout_s, backward, kept_gathers)
    q = val(region.inputs["q"])
    dtype = str(q.dtype).removeprefix("torch.")
    machine = machine_for(q.device, region.world, region.group_name, dtype, cache_dir, timeout_s)
    ranked = rank_schedules(region.shape, world=region.world, causal=region.causal, dtype=dtype,
                            machine=machine, backward=backward, depths=True)
    shown = f"predicted{' forward + backward' if backward else ''}: {_shown(ranked)}"
    if schedule != "auto":
        why = refusal(schedule, region.shape, region.world, region.causal)
        if why is not None:
            raise ValueError(f"Config.attention_schedule: {schedule!r} cannot take {tuple(region.shape)} over "
                             f"{region.world} ranks: {why}")
        return schedule, ranked, f"named by Config.attention_schedule; {shown}"
    if mode != "autotune":
        return ranked[0][0], ranked, shown
    from torch_commopt.tuner.attention import tune
    from torch_commopt.tuner.machine import device_name

    _, top, key = tune.question(region.shape, region.world, region.causal, dtype, backward, device_name(q.device),
                                machine, top_k)
    entry = tune.cached(key, region.group_name, cache_dir, timeout_s)
    if entry is None:
        spec = tune.format_spec(region.shape, region.causal, backward)
        return ranked[0][0], ranked, (f"{shown}; autotune: this shape was not measured (`python -m torch_commopt "
                                      f"tune --attention {spec} --world {region.world}` measures it): the model's pick")
    measured = sorted(entry["measured_ms"].items(), key=lambda kv: kv[1])
    return entry["schedule"], ranked, ("measured: " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in measured[:5])
                                       + f" (cached); {shown}")


def _choose_flex(region: AttentionRegion, schedule: str, cache_dir: str | None, timeout_s: float,
                 backward: bool, kept_gathers: bool = False) -> tuple[str, list[tuple[str, float]], str]:
    """_choose for flex_attention: the named schedule (checked), else the flex model's first
    (tuner/attention/flex_cost.py) for a causal mask's work -- the mask's tables are a batch's
    data, not the graph's -- with the machine's calibration (rank 0's; else the priors)."""
    from torch_commopt.core.attention_spec import parse_flex_schedule
    from torch_commopt.tuner.attention.flex_cost import causal_work, rank_flex_schedules, ulysses_ms

    q = val(region.inputs["q"])
    dtype = str(q.dtype).removeprefix("torch.")
    machine = machine_for(q.device, region.world, region.group_name, dtype, cache_dir, timeout_s)
    # kv_num (B|1, H|1, rows), or SDPA's dense mask (B|1, H|1, rows, keys): one mask per head?
    per_head = val(region.flex.buffers[0] if region.flex.dense else region.flex.tables[0]).shape[1] > 1
    own_rows = region.flex.sizes[0] != region.flex.sizes[1]  # the mask of the rank's rows only
    work = causal_work(region.world)
    ranked = rank_flex_schedules(region.shape, work, dtype=dtype, machine=machine, backward=backward,
                                 per_head_mask=per_head, own_rows=own_rows, kept_gathers=kept_gathers)
    if region.form == "flex_ulysses":  # leaving the program's own Ulysses is a candidate too
        kept = ulysses_ms(region.shape, work, dtype=dtype, machine=machine, backward=backward)
        ranked = sorted(ranked + [(KEEP_ULYSSES, kept)], key=lambda e: e[1])
    shown = f"predicted{' forward + backward' if backward else ''} at a causal mask's work: {_shown(ranked)}"
    if schedule == "auto":
        return ranked[0][0], ranked, shown
    parse_flex_schedule(schedule)  # a ValueError naming the schedules it takes
    if schedule.startswith("hybrid") and schedule not in dict(ranked):
        raise ValueError(f"flex cp schedule {schedule!r} cannot run here: it needs U * R = {region.world} ranks, U "
                         f"splitting the heads, and the whole sequence's mask the same for every head "
                         f"(this one: {'per head' if per_head else 'one for every head'}, "
                         f"{'the rank s own rows' if own_rows else 'the whole sequence'})")
    return schedule, ranked, f"named by Config.attention_schedule; {shown}"


def _apply(graph: Graph, region: AttentionRegion, schedule: str) -> None:
    node = region.attention
    with graph.inserting_before(node):
        k = _local(graph, region, "k")
        v = _local(graph, region, "v")
        cp = add_node(graph, torch.ops.commopt.cp_attention_fwd.default,
                      (region.inputs["q"], k, v, schedule, region.causal, region.scale, region.world, region.group_name))
        out = add_node(graph, operator.getitem, (cp, 0))
    region.output.replace_all_uses_with(out)
    erase_unused(graph, [node, *node.users, *region.paths["k"], *region.paths["v"]], region.collectives)


def _apply_decode(graph: Graph, region: AttentionRegion) -> None:
    """decode_kv: the queries against this rank's share of the cache (k and v before their
    gathers, through the same layout ops), the mask cut to this rank's columns."""
    node = region.attention
    with graph.inserting_before(node):
        k = _local(graph, region, "k")
        v = _local(graph, region, "v")
        mask = region.inputs.get("mask")
        if mask is not None:
            mask = add_node(graph, torch.ops.commopt.shard_rows.default, (mask, region.world, region.group_name, False, -1))
        out = add_node(graph, torch.ops.commopt.decode_attention.default,
                       (region.inputs["q"], k, v, mask, region.scale, region.world, region.group_name))
    region.output.replace_all_uses_with(out)
    erase_unused(graph, [node, *node.users, *region.paths["k"], *region.paths["v"]], region.collectives)


def _apply_flex(graph: Graph, region: AttentionRegion, schedule: str) -> None:
    """flex_allgather_kv: one cp_flex_attention_fwd on the local q and the rank's own K and V,
    with the mask's tables, code and buffers as the graph holds them; the gathers go."""
    node = region.attention
    with graph.inserting_before(node):
        k = _local(graph, region, "k")
        v = _local(graph, region, "v")
        pair = add_node(graph, torch.ops.commopt.cp_flex_attention_fwd.default,
                        (region.inputs["q"], k, v, *flex_arguments(graph, region, schedule)))
        out = add_node(graph, operator.getitem, (pair, 0))
    region.output.replace_all_uses_with(out)
    erase_unused(graph, [node, *node.users, *region.paths["k"], *region.paths["v"]], region.collectives)


def flex_arguments(graph: Graph, region: AttentionRegion, schedule: str) -> tuple:
    """cp_flex_attention_fwd/bwd's arguments after the tensors, for a flex region (inserted where
    the graph's insertion point is): SDPA's dense mask gets its block tables made from it at run
    time, once for both passes."""
    mask = region.flex
    tables = mask.tables
    if mask.dense:
        made = add_node(graph, torch.ops.commopt.dense_block_tables.default, (mask.buffers[0], mask.sizes[2]))
        tables = [add_node(graph, operator.getitem, (made, i)) for i in range(4)]
    scale = region.scale if region.scale is not None else region.shape.head_dim ** -0.5
    return (tables, mask.buffers, mask.code, mask.sizes, scale, region.world, region.group_name, schedule)


def _apply_ulysses(graph: Graph, region: AttentionRegion, plan: ulysses.UlyssesPlan, schedule: str) -> None:
    with graph.inserting_before(region.attention):
        flex_args = flex_arguments(graph, region, schedule) if region.flex is not None else None
    ulysses.apply(graph, region, plan, schedule, flex_args)
    node = region.attention
    pre = [n for key in "qkv" for n in region.paths[f"{key}_pre"]]
    post = [n for key in "qkv" for n in region.paths[f"{key}_post"]] + region.paths["out"]
    erase_unused(graph, [node, *node.users, *post, *pre], region.collectives)


def _local(graph: Graph, region: AttentionRegion, name: str) -> Node:
    """The rank's own K (or V) in the attention's layout: the gather's input through the same
    layout ops, with the gathered dim's size divided by W where an op names sizes."""
    gather = region.collectives[0 if name == "k" else 1]
    x, path = gather.args[0], region.paths[name]
    if not path:  # the gathered tensor feeds the attention as it is: the shard has its layout
        return x
    origin = path[0].args[0]  # the gathered tensor (the wait, or the cat of the dim > 0 form)
    dim = _gathered_dim(gather, origin)
    for i, op in enumerate(path):
        args = list(op.args)
        if op.target in RESIZE:
            sizes = list(static_shape(op))
            sizes[_map_dim(dim, origin, path[: i + 1])] //= region.world
            args[1] = sizes
        x = add_node(graph, op.target, (x, *args[1:]), dict(op.kwargs))
    return x


def _gathered_dim(gather: Node, origin: Node) -> int:
    """The dim of `origin` (the gathered tensor) that the gather grew."""
    local, full = static_shape(gather.args[0]), static_shape(origin)
    diff = [d for d, (a, b) in enumerate(zip(local, full)) if a != b]
    if len(diff) != 1:
        raise ValueError(f"commopt attention: cannot tell the gathered dim of {origin.name} ({local} -> {full})")
    return diff[0]


def erase_unused(graph: Graph, first: list[Node], collectives: list[Node]) -> None:
    """Erase, of `first` and of everything downstream of `collectives` (the replaced
    collectives, or any node whose whole downstream was replaced), what nothing uses any more."""
    chain = set(first)
    for gather in collectives:
        todo = [gather]
        while todo:
            n = todo.pop()
            if n not in chain:
                chain.add(n)
                todo += list(n.users)
    for n in reversed(list(graph.nodes)):
        if n in chain and not n.users:
            graph.erase_node(n)


def insert_training_forward(graph: Graph, q: Node, k: Node, v: Node, common: tuple) -> tuple[Node, tuple[Node, ...]]:
    """The joint graph's forward op at the insertion point, for `common` = (schedule, causal,
    scale, world, group name): (out, saved), saved being what insert_training_backward takes --
    the kept tensors of cp_attention_fwd_keep for a schedule that moves its inputs (the
    backward then moves dout alone), else q, k, v, out, lse of cp_attention_fwd."""
    schedule, causal, _, world, _ = common
    if schedules.moves_inputs(schedule, world, causal):
        cp = add_node(graph, torch.ops.commopt.cp_attention_fwd_keep.default, (q, k, v, *common))
        items = [add_node(graph, operator.getitem, (cp, i)) for i in range(1 + len(schedules.KEPT))]
        return items[0], tuple(items[1:])
    cp = add_node(graph, torch.ops.commopt.cp_attention_fwd.default, (q, k, v, *common))
    out, lse = add_node(graph, operator.getitem, (cp, 0)), add_node(graph, operator.getitem, (cp, 1))
    return out, (q, k, v, out, lse)


def insert_training_backward(graph: Graph, dout: Node, saved: tuple[Node, ...], common: tuple) -> Node:
    """The backward op of insert_training_forward's pair at the insertion point: dq, dk, dv."""
    schedule, causal, _, world, _ = common
    op = torch.ops.commopt.cp_attention_bwd_kept if schedules.moves_inputs(schedule, world, causal) \
        else torch.ops.commopt.cp_attention_bwd
    return add_node(graph, op.default, (dout, *saved, *common))
