"""(b) of issue 69: a whole tensor-parallel decoder step, Llama-3-8B-shaped, replayed from CUDA graphs.

The model (benchmarks/decode_model.py) is a gpt-fast-style decoder in plain torch modules: RMSNorm, RoPE, a static KV cache
[B, kv_heads / W, ctx, head_dim] per layer, one new token per step at `input_pos`, and SDPA over
the cache with a mask of the valid positions. Its weights are random, from a fixed seed. It is split
over W ranks the gpt-fast way:
- wqkv and w1/w3 are column-parallel (each rank holds its query and KV heads);
- wo and w2 are row-parallel, each followed by torch's functional all-reduce (what Dynamo traces,
  and what commopt's finder matches: matmul -> all_reduce -> wait_tensor);
- the embedding and the output head are replicated.
Every rank's weights and cache are slices of one full set, generated per layer and per KV head
from seeds. So the model at world 1 (no collective) is the unsharded reference. Attention groups
the query heads by their KV head (q as [B, kv_heads, heads / kv_heads, head_dim]), so SDPA reads
each KV head's cache once, as a GQA decode kernel does, instead of once per query head.

Variants on W GPUs (NCCL), each compiled with Inductor's CUDA-graph trees and replayed:
    inductor+nccl       torch.compile(mode="reduce-overhead"): cuBLAS, NCCL's all-reduce
    inductor+symm_mem   the same, with Inductor lowering every all-reduce to torch's symm-mem
                        one-shot (`_collective.auto_select` on, the group's symmetric memory
                        enabled, the threshold raised to the step's message)
    commopt             torch.compile(backend="commopt", mode="reduce-overhead"): the rule picks
                        each region's schedule, ranked as replayed
    commopt oneshot     commopt with every region fixed to `oneshot` (mode="fixed", cuda_graphs)
    inductor comm-free  a bound, not a backend: inductor+nccl's program with every collective taken
                        out (benchmarks/comm_free.py); its logits are meaningless
On one GPU shared by the ranks (`--shared`: TORCH_COMMOPT_SHARED_DEVICE=1, gloo; correctness
only), NCCL and torch's symmetric memory cannot run (reported as not run, as is the bound, whose
only figure is a time). There the variants are the unsharded model (`unsharded`, compiled the same
way), `commopt oneshot` and `commopt`. A commopt graph that would
still run a collective over gloo on CUDA tensors is refused before it runs, and so is reported as not
run. On CPU (gloo smoke, tiny dims, no CUDA graphs) they are the sharded model in eager mode,
Inductor, commopt's rule, commopt `gather_sum` and the comm-free bound.

Per case (batch x context) and variant:
- ms per token: the median over rounds of `steps` steps back to back, on the slowest rank, with the
  variants taken in turns and the order rotated each round;
- tokens/s;
- the largest |delta logits| against the reference variant (inductor+nccl on GPUs, the unsharded
  model elsewhere) and against the truth: the same step in higher precision (float32 on GPUs,
  float64 on CPU; the unsharded model where one is built, else the sharded one with eager
  all-reduces), reading the same stored weights and cache;
- agreement: the error against the truth within validate.TOLERANCE_FACTOR times the reference
  variant's own, and the same logits on every rank;
- the graphs Inductor did not replay from CUDA graphs (none expected), and what commopt rewrote.
Where the time goes: the bytes a rank must read per step (its weights, the B embedding rows, its
share of the KV cache over ctx) over HBM_BYTES_PER_S is the HBM floor. A variant's all-reduce time
is its step minus the comm-free bound's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import max_over_ranks, schedule_ran, with_env
from benchmarks.decode_model import LLAMA3_8B, SEED, TINY, TP, Case, Shape, build, step_bytes
from benchmarks.render_decode_step import BOUND, HBM_BYTES_PER_S, derive, report, table_row
from torch_commopt.core import env

REFERENCE = {"gpu": "inductor+nccl", "shared": "unsharded", "cpu": "unsharded"}
# In the order they are compiled (and listed); timed in turns. torch's symm-mem lowering last: it is the one
# most likely to fail inside a CUDA-graph capture, which can leave the CUDA context unusable after it.
VARIANTS = {"gpu": ("inductor+nccl", "commopt", "commopt oneshot", "inductor comm-free", "inductor+symm_mem"),
            "shared": ("unsharded", "commopt oneshot", "commopt", "inductor+nccl", "inductor+symm_mem", "inductor comm-free"),
            "cpu": ("unsharded", "eager", "inductor", "commopt", "commopt gather_sum", "inductor comm-free")}
# Variants run only when asked for (--variants): commopt's rule with the GPU-wait watchdog off while
# it compiles, captures and replays -- the low-latency kernels take their spin bound at the capture
# (kernels/gpu/watchdog.py), so the pair measures what the watchdog costs a decode step.
OPTIONAL = {"gpu": ("commopt watchdog off",)}
VARIANT_ENV = {"commopt watchdog off": {env.WATCHDOG: "0"}}
NOT_RUN_SHARED = {"inductor+nccl": "NCCL refuses two ranks on one GPU",
                  "inductor+symm_mem": "torch's symmetric memory refuses ranks that share a device",
                  BOUND: "a bound's only figure is a time, and ranks sharing one GPU give no timing"}


GPU_CASES = tuple(Case(batch=b, ctx=c) for b in (1, 8, 32) for c in (4096, 32768))
SHARED_CASES = tuple(Case(batch=b, ctx=c) for b in (1, 8) for c in (4096, 32768))
SHARED_LAYERS = 4
CPU_CASES = (Case(batch=2, ctx=32),)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures: its mode ("gpu", "shared" or "cpu"), shape, cases, variants and timing."""

    mode: str
    shape: Shape
    cases: tuple[Case, ...]
    variants: tuple[str, ...]
    rounds: int = 15
    steps: int = 10  # decode steps back to back per timed turn
    partial: str | None = None  # a JSONL file rank 0 appends each finished case's record to


# ---------------------------------------------------------------- the variants


def _refuse_gloo_collectives(mode: str | None, options: dict | None) -> Callable:
    """commopt's backend, refusing (RuntimeError at compile, before anything runs) a graph that
    would still run a collective, or a schedule that is not a GPU one. Over gloo on a GPU the
    ranks share, torch's functional collectives on CUDA tensors crash the process
    (tests/gpu/results/shared_gpu_funcol_segfault_h200_2026-11-25.txt), and gloo cannot run
    inside a CUDA graph.  A first-call measurement (`autotune` placeholder: the rule's replayed
    small all-reduce band) passes: its candidates are timed as CUDA-graph replays, so NCCL's
    `sequential`, whose gloo call no graph captures, drops out and a GPU schedule is decided."""
    import torch_commopt
    from torch_commopt.backend import commopt_backend
    from torch_commopt.core.schedule import Schedule

    def backend(gm, example_inputs):
        seen = len(torch_commopt.explain().graphs)
        compiled = commopt_backend(gm, example_inputs, options=options, mode=mode)
        graphs = torch_commopt.explain().graphs[seen:]
        left = {k: v for g in graphs for k, v in g.collectives_after.items() if v}
        off_gpu = sorted({r.schedule for g in graphs for r in g.regions
                          if not Schedule.parse(r.schedule).is_gpu and Schedule.parse(r.schedule).name != "autotune"})
        if left or off_gpu:
            raise RuntimeError(f"not run on a shared GPU: collectives left {left}, schedules off the GPU {off_gpu}")
        return compiled

    return backend


COMMOPT_OPTIONS = {"commopt gather_sum": {"schedule": "gather_sum", "mode": "fixed"},
                   "commopt oneshot": {"schedule": "oneshot", "mode": "fixed", "cuda_graphs": True}}


def _commopt(variant: str, model: nn.Module, plan: Plan) -> nn.Module:
    """torch.compile(backend="commopt"): its rule (mode="reduce-overhead" on the GPU), or a fixed schedule."""
    options = COMMOPT_OPTIONS.get(variant)
    mode = "reduce-overhead" if options is None and plan.mode != "cpu" else None
    if plan.mode == "shared":
        return torch.compile(model, backend=_refuse_gloo_collectives(mode, options), dynamic=False)
    kwargs = {"options": options} if options else {"mode": mode} if mode else {}
    return torch.compile(model, backend="commopt", dynamic=False, **kwargs)


def _symm_mem(model: nn.Module, message_bytes: int, group) -> nn.Module:
    """Inductor with every all-reduce of the step lowered to torch's symm-mem one-shot
    (torch/_inductor/comm_lowering.py: `_collective.auto_select` with symmetric memory enabled
    for the group, up to `one_shot_all_reduce_threshold_bytes`, here raised to the step's
    message); ValueError where this torch has no such lowering."""
    from torch._inductor import config as inductor_config

    if "_collective.auto_select" not in inductor_config.get_config_copy() or not hasattr(
            torch.ops.symm_mem, "one_shot_all_reduce"):
        raise ValueError("this torch has no symm-mem one-shot lowering (_collective.auto_select)")
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(group.group_name)
    return _Graphed(torch.compile(model, dynamic=False, options={
        "_collective.auto_select": True,
        "_collective.one_shot_all_reduce_threshold_bytes": max(message_bytes, 128 * 1024)}))


class _Graphed:
    """A compiled step replayed from one CUDA graph captured by hand at its third call, after
    two eager ones (the compile and a warm-up: the lowering's symmetric buffers, kept by
    allocation id, exist before the capture).  For torch's symm-mem lowering: CUDA-graph trees
    refuse its buffers ("tensors in the cudagraph pool not tracked as outputs", torch 2.11), and
    that failure inside a capture left the CUDA context unusable for the next case.  The inputs
    must be the same tensors at every call after the capture (the benchmark's are)."""

    def __init__(self, fn: Callable):
        self.fn, self.calls, self.graph, self.out, self.args = fn, 0, None, None, ()

    def __call__(self, *args):
        if self.graph is None:
            self.calls += 1
            if self.calls < 3:
                return self.fn(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self.fn(*args)
            self.graph, self.args = graph, args
        if len(args) != len(self.args) or any(a is not b for a, b in zip(args, self.args)):
            raise ValueError("a captured step takes the tensors it was captured with")
        self.graph.replay()
        return self.out


def _inductor(variant: str, model: nn.Module, plan: Plan) -> nn.Module:
    """Inductor (CUDA-graph trees on the GPU, as mode="reduce-overhead"), or the comm-free bound."""
    from benchmarks import comm_free

    graphs = {"triton.cudagraphs": True} if plan.mode != "cpu" else {}
    if variant == BOUND:
        return torch.compile(model, dynamic=False, options={**graphs, **comm_free.OPTIONS})
    if plan.mode == "cpu":
        return torch.compile(model, dynamic=False)
    return torch.compile(model, mode="reduce-overhead", dynamic=False)


def compiled(variant: str, models: dict, plan: Plan, case: Case, group) -> Callable:
    """The step of `variant`: a callable (tokens, input_pos) -> logits."""
    if variant == "eager":
        return models["sharded"]
    if variant == "unsharded":
        if plan.mode == "cpu":
            return models["unsharded"]
        return torch.compile(models["unsharded"], mode="reduce-overhead", dynamic=False)
    if variant in VARIANT_ENV:  # a backend object of its own: Dynamo would reuse commopt's compiled step
        from torch_commopt.backend import commopt_backend

        mode = "reduce-overhead" if plan.mode == "gpu" else None
        step = torch.compile(models["sharded"], backend=functools.partial(commopt_backend, mode=mode), dynamic=False)
        return with_env(step, VARIANT_ENV[variant])
    if variant.startswith("commopt"):
        return _commopt(variant, models["sharded"], plan)
    if variant == "inductor+symm_mem":
        itemsize = models["sharded"].output.element_size()
        return _symm_mem(models["sharded"], case.batch * plan.shape.dim * itemsize, group)
    return _inductor(variant, models["sharded"], plan)


# ---------------------------------------------------------------- one case


def _inputs(shape: Shape, case: Case, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, 1], input_pos [1]): the cache's last position, so each step attends over all of it."""
    g = torch.Generator(device="cpu").manual_seed(SEED + 7)
    tokens = torch.randint(0, shape.vocab, (case.batch, 1), generator=g).to(device)
    return tokens, torch.tensor([case.ctx - 1], device=device)


# The all-reduces a compiled program calls, as Inductor's wrapper code spells them
COLLECTIVE_CALLS = {"nccl all_reduce": re.compile(r"torch\.ops\._c10d_functional\.all_reduce_?\.default\("),
                    "symm_mem one_shot": re.compile(r"torch\.ops\.symm_mem\.one_shot_all_reduce\w*\.default\("),
                    "commopt matmul_ar": re.compile(r"torch\.ops\.commopt\.matmul_ar\.default\(")}


def collective_calls(codes: list[str]) -> dict[str, int] | None:
    """How many calls of each COLLECTIVE_CALLS the programs' code holds (comments left out);
    None without code (an eager variant)."""
    if not codes:
        return None
    lines = [line for code in codes for line in code.splitlines() if not line.lstrip().startswith("#")]
    return {name: sum(len(pattern.findall(line)) for line in lines) for name, pattern in COLLECTIVE_CALLS.items()}


def _warm(call: Callable, args: tuple, variant: str) -> tuple[torch.Tensor, float, list[str]]:
    """Three calls (the compile, the CUDA-graph trees' warm-up and their recording), then one
    replay's logits, copied out; the seconds the first call took (the compile), and the code of
    the programs Inductor wrote (or loaded from its cache) for it."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    from benchmarks import comm_free

    codes: list[str] = []
    t0 = time.perf_counter()
    with comm_free.installed() if variant == BOUND else contextlib.nullcontext():
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            call(*args)
        first = time.perf_counter() - t0
        for _ in range(2):
            call(*args)
    return call(*args).float().clone(), first, codes


def _everywhere(ok: bool) -> bool:
    """Whether every rank says ok (a variant that failed on one rank is dropped on all)."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def _regions(graphs: list) -> dict:
    """What commopt did to a variant's graphs (its explain reports; a first-call measurement's
    placeholder by what it decided, once the warm-up calls ran)."""
    rewritten = [f"{r.kind} {schedule_ran(r.schedule)}" for g in graphs for r in g.regions if r.status == "rewritten"]
    return {"rewritten": len(rewritten), "kept": sum(r.status != "rewritten" for g in graphs for r in g.regions),
            "schedules": sorted(set(rewritten)), "skipped": sorted({s.reason for g in graphs for s in g.skipped}),
            "collectives_left": {k: v for g in graphs for k, v in g.collectives_after.items() if v},
            "notes": sorted({n for g in graphs for n in g.notes if n.startswith("NOT rewritten")})}


def _prepare_one(variant: str, models: dict, plan: Plan, case: Case, ctx: dict) -> Callable:
    """`variant` compiled and warmed up; its logits, compile seconds, the all-reduces its program
    calls, the graphs Inductor did not replay from CUDA graphs (cudagraph_skips) and its commopt
    regions into ctx."""
    from torch._dynamo.utils import counters

    import torch_commopt

    seen, skips = len(torch_commopt.explain().graphs), counters["inductor"]["cudagraph_skips"]
    call = compiled(variant, models, plan, case, ctx["group"])
    ctx["outs"][variant], ctx["compile_s"][variant], codes = _warm(call, ctx["args"], variant)
    ctx["collectives"][variant] = collective_calls(codes)
    ctx["cudagraph_skips"][variant] = counters["inductor"]["cudagraph_skips"] - skips
    if variant.startswith("commopt"):
        ctx["regions"][variant] = _regions(torch_commopt.explain().graphs[seen:])
    return call


def _why(e: BaseException) -> str:
    """A failure in one line: the backend's or Inductor's own exception where Dynamo wrapped it."""
    inner = getattr(e, "inner_exception", None) or e
    return f"{type(inner).__name__}: {' '.join(str(inner).split())[:300]}"


def prepare(models: dict, plan: Plan, case: Case, ctx: dict) -> dict:
    """{variant: step} for those that run, compiled and warmed up; the others' reasons in ctx["not_run"]."""
    steps = {}
    for v in plan.variants:
        reason = NOT_RUN_SHARED.get(v) if plan.mode == "shared" else None
        if reason:
            ctx["not_run"][v] = reason
            continue
        try:
            steps[v] = _prepare_one(v, models, plan, case, ctx)
        except Exception as e:  # noqa: BLE001  (a variant that cannot run here: reported with its reason)
            reason = _why(e)
        if not _everywhere(reason is None):
            steps.pop(v, None)
            ctx["outs"].pop(v, None)
            ctx["not_run"][v] = reason or "failed on another rank"
    return steps


def _time_turn(step: Callable, args: tuple, steps: int, cuda: bool) -> float:
    """ms per step of `steps` steps back to back."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*args)
    return (time.perf_counter() - t0) * 1e3 / steps


def time_variants(steps_by_variant: dict, args: tuple, plan: Plan, cuda: bool) -> dict[str, list[float]]:
    """Every variant timed in turns, `plan.rounds` rounds, the order rotated each round."""
    import torch.distributed as dist

    order = list(steps_by_variant)
    times = {v: [] for v in order}
    for r in range(plan.rounds):
        for v in order[r % len(order):] + order[: r % len(order)]:
            dist.barrier()
            times[v].append(_time_turn(steps_by_variant[v], args, plan.steps, cuda))
    return times


def truth(models: dict, plan: Plan, args: tuple) -> torch.Tensor:
    """The step in higher precision (float32; float64 on CPU) from the same stored weights and
    cache: the unsharded model where one is built, else the sharded one (its all-reduces eager)."""
    model = models["unsharded"] if "unsharded" in models else models["sharded"]
    dtype = torch.float64 if plan.mode == "cpu" else torch.float32
    tokens, input_pos = args
    with torch.no_grad():
        return model.decode(F.embedding(tokens, model.tok_embeddings).to(dtype), input_pos).double()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether every rank holds the same bits (gathered on the CPU over gloo)."""
    import torch.distributed as dist

    mine = t.cpu() if dist.get_backend() == "gloo" else t
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return all(torch.equal(x, gathered[0]) for x in gathered)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64."""
    return (a.double() - b.double()).abs().max().item()


def _models(plan: Plan, case: Case, rank: int, world: int, device) -> dict:
    """This rank's sharded decoder, and the unsharded one where a variant runs it."""
    import torch.distributed as dist

    dtype = torch.float32 if plan.mode == "cpu" else torch.bfloat16
    models = {"sharded": build(plan.shape, TP(rank, world, dist.group.WORLD), case, device, dtype)}
    if "unsharded" in plan.variants:
        models["unsharded"] = build(plan.shape, TP(0, 1), case, device, dtype)
    return models


def summarize(times: dict, ctx: dict, exact: torch.Tensor, plan: Plan, reduce_on) -> dict:
    """The case's raw figures, each the slowest rank's (the largest error) where ranks differ:
    median ms per step; max |delta logits| vs the truth and vs the reference variant; whether
    each variant's logits are the same on every rank."""
    outs, names = ctx["outs"], list(times)
    ref = outs.get(REFERENCE[plan.mode])
    vs_truth = [_max_abs(outs[v], exact) for v in names]
    vs_ref = [_max_abs(outs[v], ref) if ref is not None else 0.0 for v in names]
    differ = [0.0 if _same_on_every_rank(outs[v]) else 1.0 for v in names]
    flat = max_over_ranks([statistics.median(times[v]) for v in names] + vs_truth + vs_ref + differ, reduce_on)
    n = len(names)
    return {"ms": dict(zip(names, flat[:n])), "raw_ms": times,
            "max_abs_vs_truth": dict(zip(names, flat[n:2 * n])),
            "max_abs_vs_reference": dict(zip(names, flat[2 * n:3 * n])) if ref is not None else {},
            "same_on_every_rank": {v: d == 0.0 for v, d in zip(names, flat[3 * n:])},
            "logit_scale": exact.abs().max().item(), "reference": REFERENCE[plan.mode],
            "compile_s": ctx["compile_s"], "regions": ctx["regions"], "not_run": ctx["not_run"],
            "cudagraph_skips": ctx["cudagraph_skips"], "collective_calls": ctx["collectives"]}


def run_case(rank: int, world: int, plan: Plan, case: Case, device) -> dict:
    """One case on this rank: its variants compiled, warmed up, timed in turns and compared."""
    import torch.distributed as dist

    from benchmarks.compiled_variants import allow_entries, check_unchanged, compile_counts

    torch._dynamo.reset()
    allow_entries(len(plan.variants) + 1)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    models = _models(plan, case, rank, world, device)
    ctx = {"group": dist.group.WORLD, "args": _inputs(plan.shape, case, device), "compile_s": {}, "outs": {},
           "regions": {}, "not_run": {}, "cudagraph_skips": {}, "collectives": {}}
    with torch.no_grad():
        steps = prepare(models, plan, case, ctx)
        before = compile_counts()
        times = time_variants(steps, ctx["args"], plan, cuda)
        check_unchanged(before, f"decode step {case}")
    reduce_on = device if plan.mode == "gpu" else "cpu"
    record = {"batch": case.batch, "ctx": case.ctx, "bytes_per_step": step_bytes(
        plan.shape, case, world, 4 if plan.mode == "cpu" else 2),
        **summarize(times, ctx, truth(models, plan, ctx["args"]), plan, reduce_on)}
    if cuda:
        record["peak_gib_per_rank"] = max_over_ranks([torch.cuda.max_memory_allocated(device) / 2**30], reduce_on)[0]
    del models, steps, ctx
    gc.collect()
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return record


def rank_main(rank: int, world: int, plan: Plan) -> tuple[list[dict], str]:
    """Every case of `plan` on this rank: (records, device name)."""
    import torch_commopt  # noqa: F401  (registers the backend and the ops)

    if plan.mode == "cpu":
        # one compile thread per rank: a pool of compile workers costs more than it saves here
        with torch._inductor.config.patch(compile_threads=1):
            return [run_case(rank, world, plan, case, torch.device("cpu")) for case in plan.cases], "cpu (gloo)"
    torch.cuda.set_device(0 if plan.mode == "shared" else rank)
    device = torch.device("cuda", torch.cuda.current_device())
    records = [_kept(run_case(rank, world, plan, case, device), rank, plan) for case in plan.cases]
    return records, torch.cuda.get_device_name(device)


def _kept(record: dict, rank: int, plan: Plan) -> dict:
    """`record`, also printed and appended to plan.partial by rank 0: a run cut short keeps the
    cases it finished."""
    if rank == 0:
        import json

        (shown,) = derive([dict(record)])
        print(f"batch {record['batch']}, context {record['ctx']}:", *(table_row(shown, v) for v in shown["ms"]),
              *(f"- not run: {v}: {why}" for v, why in record["not_run"].items()), sep="\n", flush=True)
        if plan.partial:
            with open(plan.partial, "a") as f:
                f.write(json.dumps(record) + "\n")
    return record


# ---------------------------------------------------------------- figures and the report


# ---------------------------------------------------------------- the command line (bench_decode --step)


def add_arguments(p) -> None:
    """bench_decode's --step options."""
    p.add_argument("--step", action="store_true", help="(b): a whole decoder step (benchmarks/decode_step.py)")
    p.add_argument("--shared", action="store_true", help="--step with the ranks on one GPU over gloo (correctness)")
    p.add_argument("--layers", type=int, default=None, help="--step: the model cut to this many layers")
    p.add_argument("--batch", default=None, help="--step: batch sizes, e.g. 1,8,32")
    p.add_argument("--ctx", default=None, help="--step: contexts, e.g. 4096,32768")
    p.add_argument("--variants", default=None, help="--step: the variants, comma-separated ('_' for a space)")
    p.add_argument("--steps", type=int, default=10, help="--step: decode steps back to back per timed turn")


def _ints(text: str | None, default: list[int]) -> list[int]:
    """'1,8,32' -> [1, 8, 32]; `default` when not given."""
    return [int(x) for x in text.split(",")] if text else default


def plan_from(args) -> Plan:
    """The Plan the command line asks for; ValueError naming a bad option."""
    mode = "cpu" if args.cpu else "shared" if args.shared else "gpu"
    base = TINY if mode == "cpu" else LLAMA3_8B
    shape = dataclasses.replace(base, layers=args.layers or (SHARED_LAYERS if mode == "shared" else base.layers))
    default = {"cpu": CPU_CASES, "shared": SHARED_CASES, "gpu": GPU_CASES}[mode]
    batches = _ints(args.batch, sorted({c.batch for c in default}))
    ctxs = _ints(args.ctx, sorted({c.ctx for c in default}))
    variants = VARIANTS[mode]
    if args.variants:
        variants = tuple(v.strip().replace("_", " ") for v in args.variants.split(",") if v.strip())
        known = VARIANTS[mode] + OPTIONAL.get(mode, ())
        unknown = set(variants) - set(known) - set(NOT_RUN_SHARED)
        if unknown:
            raise ValueError(f"--variants: unknown {sorted(unknown)}; known here: {known}")
    bad = [f"{name} {getattr(shape, name)}" for name in ("heads", "kv_heads", "ffn") if getattr(shape, name) % args.world]
    if bad:
        raise ValueError(f"--world {args.world} does not split {', '.join(bad)}")
    # CPU and a shared GPU time nothing worth the rounds: a few show that every variant replays
    rounds, steps = {"cpu": (2, 2), "shared": (3, 5)}.get(mode, (args.rounds, args.steps))
    return Plan(mode=mode, shape=shape, cases=tuple(Case(batch=b, ctx=c) for b in batches for c in ctxs),
                variants=variants, rounds=rounds, steps=steps)


def main_step(args) -> None:
    """bench_decode --step: the plan run, its report printed, and written (GPU modes, with --out)."""
    from benchmarks.common import machine_meta, result_stem, write_report
    from torch_commopt.testing.launch import run_distributed

    try:
        plan = plan_from(args)
    except ValueError as e:
        raise SystemExit(f"bench_decode --step: {e}") from e
    if plan.mode == "shared":
        os.environ[env.SHARED_DEVICE] = "1"  # the ranks take this process's environment
    if args.out and plan.mode != "cpu":
        os.makedirs(args.out, exist_ok=True)
        plan = dataclasses.replace(plan, partial=os.path.join(args.out, f"decode_step_{report_variant(plan)}.partial.jsonl"))
    backend = "nccl" if plan.mode == "gpu" else "gloo"
    records, device = run_distributed(rank_main, args.world, plan, backend=backend, timeout_s=3600)[0]
    name = "Llama-3-8B-shaped" if plan.shape.dim == LLAMA3_8B.dim else "tiny"
    meta = machine_meta(device, args.world, args.commit, rounds=plan.rounds, steps=plan.steps, mode=plan.mode,
                        shape=dataclasses.asdict(plan.shape), shape_name=f"{name}, {plan.shape.layers} layers",
                        hbm_bytes_per_s=HBM_BYTES_PER_S)
    text = report(derive(records), meta)
    print(text)
    if args.out and plan.mode != "cpu":
        write_report(args.out, result_stem("decode_step", device, args.world, variant=report_variant(plan)),
                     {"meta": meta, "cases": records}, text)


def report_variant(plan: Plan) -> str:
    """The report's name suffix: what it measured (layers, batches, contexts, shared GPU), so that
    runs of different cases, split over several calls, do not replace one another."""
    batches = "-".join(str(b) for b in sorted({c.batch for c in plan.cases}))
    ctxs = "-".join(f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in sorted({c.ctx for c in plan.cases}))
    return (f"{plan.shape.layers}l_b{batches}_c{ctxs}" + ("_shared1gpu" if plan.mode == "shared" else "")
            + ("_watchdog" if "commopt watchdog off" in plan.variants else ""))
