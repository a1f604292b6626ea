"""Measured choice of a context-parallel attention schedule (Config.mode = "autotune").

The attention model (tuner/attention/cost.py) ranks the schedules; with mode="autotune" the rewrite
asks the tuner cache -- rank 0's answer, published through the c10d store (tuner/decide.py) --
for a measurement of the region's shape and runs its winner.  The measurement is made outside
the compile: `python -m torch_commopt tune --attention B,H,HKV,S,D[:causal][:train]` on the
program's GPUs, or `measure_and_store` from a script whose process group is up (every rank).
Where the cache has none, the model's pick runs and explain says how to measure.

Why not at the first call, as the matmul regions do (tuner/matmul/autotune.py): a training graph's
kept tensors have the chosen schedule's shapes (schedules.kept_shapes), fixed when the graph is
traced, so the schedule cannot change after the compile.

What is timed: the model's top-k (head-group depths included, cost.depth_variants), the other
depths of the pipelined schedules among them (`ulysses:g=1` against two groups: the model weighs
the moves a group hides against its launches, not the split's cost to the attention kernel,
0.16-0.53 ms at 16K on one H200 -- docs/context-parallel-attention.md)
and the all-gather reference; forward alone for an inference graph, forward + backward (the
autograd pair the training rewrite emits) for a training graph.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from torch_commopt.core.attention_spec import AttentionShape, CPSchedule, refusal
from torch_commopt.tuner.attention.cost import depth_variants, rank_schedules

log = logging.getLogger("torch_commopt.tuner.attention.tune")


def timed_candidates(ranked: list[tuple[str, float]], shape: AttentionShape, world: int, causal: bool,
                     dtype: str, top_k: int) -> list[str]:
    """What a measurement times for the model's ranking: its top_k, the other head-group depths
    of each pipelined schedule among them (its plain name and cost.depth_variants, where the
    top_k did not already hold them), and `allgather`."""
    top = [name for name, _ in ranked[:top_k]]
    for name in list(top):  # each one's depth family: the plain name (the rule's depth) and the others
        sched = CPSchedule.parse(name)
        plain = CPSchedule(sched.name, sched.ulysses, sched.ring)
        for member in [plain, *depth_variants(plain, shape, world=world, causal=causal, dtype=dtype)]:
            if str(member) not in top and refusal(member, shape, world, causal) is None:
                top.append(str(member))
    if "allgather" not in top and any(name == "allgather" for name, _ in ranked):
        top.append("allgather")
    return top


def cache_key(shape: AttentionShape, world: int, causal: bool, dtype: str, backward: bool, device: str,
              candidates: list[str]) -> dict[str, Any]:
    """The tuner-cache key of one attention measurement (everything that changes the answer)."""
    from torch_commopt.tuner.machine import machine_key
    from torch_commopt.tuner.matmul.autotune import read_key

    return {"question": "attention", **machine_key(device, world), "shape": list(AttentionShape(*shape)),
            "causal": bool(causal), "dtype": dtype, "backward": bool(backward), "candidates": list(candidates),
            **read_key()}


def question(shape: AttentionShape, world: int, causal: bool, dtype: str, backward: bool, device: str, machine,
             top_k: int) -> tuple[list[tuple[str, float]], list[str], dict[str, Any]]:
    """(the model's ranking, the candidates to time, the cache key) of one attention shape: the
    one definition the rewrite and the tune command share, so a prefilled cache answers the
    rewrite."""
    ranked = rank_schedules(shape, world=world, causal=causal, dtype=dtype, machine=machine, backward=backward,
                            depths=True)
    top = timed_candidates(ranked, AttentionShape(*shape), world, causal, dtype, top_k)
    return ranked, top, cache_key(shape, world, causal, dtype, backward, device, top)


def cached(key: dict[str, Any], group_name: Optional[str], cache_dir: Optional[str],
           timeout_s: float) -> Optional[dict[str, Any]]:
    """Rank 0's cached measurement of `key` ({"schedule", "measured_ms"}) on every rank, or None."""
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.decide import decide

    cache = TunerCache(cache_dir)
    entry = decide(group_name, key, lambda: cache.get(key), timeout_s)
    ok = (isinstance(entry, dict) and entry.get("schedule") in key["candidates"]
          and isinstance(entry.get("measured_ms"), dict))
    return entry if ok else None


def runner(shape: AttentionShape, causal: bool, dtype: torch.dtype, backward: bool, group_name: str,
           device: torch.device, seed: int = 0):
    """run(schedule): one call of the schedule on fresh random shards of this rank (the
    program's contiguous layout), forward or forward + backward."""
    from torch_commopt.core.groups import resolve_group
    from torch_commopt.kernels.attention.ops import cp_attention

    b, h, h_kv, seq, d = AttentionShape(*shape)
    group = resolve_group(group_name)
    world, rank = group.size(), dist.get_rank(group)
    if seq % world:
        raise ValueError(f"commopt attention tune: sequence {seq} is not a multiple of the world size {world}")
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    s_loc = seq // world

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(b, heads, s_loc, d, generator=gen, device=device, dtype=dtype)

    q, k, v = rand(h), rand(h_kv), rand(h_kv)
    if not backward:
        def run(schedule: str):
            return torch.ops.commopt.cp_attention_fwd(q, k, v, schedule, causal, None, world, group_name)[0]
        return run
    dout = rand(h)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def run(schedule: str):
        for x in leaves:
            x.grad = None
        out = cp_attention(*leaves, schedule=schedule, causal=causal, group=group)
        out.backward(dout)
        return out
    return run


def measure_and_store(shape: AttentionShape, causal: bool, dtype: torch.dtype, backward: bool, *,
                      group=None, cache_dir: Optional[str] = None, top_k: int = 4,
                      timeout_s: float = 300.0) -> tuple[str, dict[str, float]]:
    """Time the candidates of one attention shape on `group` (a ProcessGroup, its name, or None
    for the default group; every rank calls it, at the same point) and store the winner where
    the rewrite looks: (winner, {schedule: ms}).
    shape: the global (batch, heads, kv_heads, seq, head_dim) of q/k/v."""
    from torch_commopt.kernels.attention.schedules import as_group
    from torch_commopt.kernels.gpu import shared_device
    from torch_commopt.tuner.attention.cost import machine_for
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.machine import device_name
    from torch_commopt.tuner.matmul.autotune import measure_candidates

    group = as_group(group)
    group_name, world = group.group_name, group.size()
    device = (torch.device("cuda", torch.cuda.current_device()) if shared_device.on_cuda(dist.get_backend(group))
              else torch.device("cpu"))
    dtype_name = str(dtype).removeprefix("torch.")
    machine = machine_for(device, world, group_name, dtype_name, cache_dir, timeout_s)
    shape = AttentionShape(*shape)
    _, top, key = question(shape, world, causal, dtype_name, backward, device_name(device), machine, top_k)
    label = f"attention {tuple(shape)}{' causal' if causal else ''}{' fwd+bwd' if backward else ' fwd'}"
    measured = measure_candidates(runner(shape, causal, dtype, backward, group_name, device), top, group_name,
                                  device, label)
    best = min(measured, key=lambda s: (measured[s], s))
    if dist.get_rank() == dist.get_process_group_ranks(group)[0]:
        TunerCache(cache_dir).put(key, {"schedule": best, "measured_ms": measured})
    log.info("commopt attention tune: %s -> %s %s", label, best, {s: round(t, 4) for s, t in measured.items()})
    return best, measured


def parse_spec(spec: str) -> tuple[AttentionShape, bool, bool]:
    """"B,H,HKV,S,D[:causal][:train]" -> (shape, causal, backward)."""
    dims, *flags = spec.split(":")
    try:
        shape = AttentionShape(*(int(x) for x in dims.split(",")))
    except (TypeError, ValueError) as e:
        raise ValueError(f"commopt tune: bad --attention {spec!r} (want B,H,HKV,S,D[:causal][:train]): {e}") from e
    unknown = set(flags) - {"causal", "train"}
    if unknown:
        raise ValueError(f"commopt tune: unknown flag(s) {sorted(unknown)} in --attention {spec!r} "
                         "(known: causal, train)")
    if min(shape) < 1 or shape.heads % shape.kv_heads:
        raise ValueError(f"commopt tune: --attention {spec!r}: sizes must be positive and kv heads must divide heads")
    return shape, "causal" in flags, "train" in flags


def format_spec(shape: AttentionShape, causal: bool, backward: bool) -> str:
    """The inverse of parse_spec: "B,H,HKV,S,D[:causal][:train]"."""
    return ",".join(str(x) for x in shape) + (":causal" if causal else "") + (":train" if backward else "")


def explain(specs: list[str], world: int, device: str, dtype: Optional[str], cache_dir: Optional[str],
            top_k: int = 4) -> str:
    """What `python -m torch_commopt explain --attention ...` prints: per shape the attention
    model's prediction for every schedule and head-group depth, fastest first, with the
    measurement the tuner cache holds for it (from `tune --attention`) and what runs under
    mode="auto"/"model" and mode="autotune".  device: "cpu" or a CUDA device name."""
    from torch_commopt.tuner.attention.cost import machine_from_calibration
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.machine import stored_calibration

    cal = stored_calibration(device, world, cache_dir)
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    machine = machine_from_calibration(cal, dtype)
    lines = [f"attention model: {cal.source} calibration of {cal.device} x{world}, {dtype}"]
    for spec in specs:
        shape, causal, backward = parse_spec(spec)
        if shape.seq % world:
            raise ValueError(f"commopt explain: --attention {spec!r}: sequence {shape.seq} is not a multiple of "
                             f"--world {world}")
        ranked, top, key = question(shape, world, causal, dtype, backward, device, machine, top_k)
        entry = TunerCache(cache_dir).get(key)
        measured = entry.get("measured_ms", {}) if isinstance(entry, dict) else {}
        lines.append(f"{spec} ({'forward + backward' if backward else 'forward'}; model picks {ranked[0][0]}"
                     + (f", autotune runs {entry['schedule']} (measured)" if measured else
                        ", not measured: autotune would run the model's pick") + "):")
        lines += [f"  {n:<18} {ms:9.3f} ms predicted" + (f", {measured[n]:.3f} ms measured" if n in measured else "")
                  + ("  (timed by tune)" if n in top else "") for n, ms in ranked]
    return "\n".join(lines)
