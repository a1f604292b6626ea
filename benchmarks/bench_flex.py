"""FlexAttention context parallelism on W GPUs: commopt next to one GPU and torch's context_parallel (issue 70).

Per case (mask, S_total; B 1, H 32 / H_kv 8, D 128, bf16, forward + backward) one run times side by side:

    single GPU      flex_attention (torch.compile'd) over the whole sequence; every rank computes it on
                    its own GPU at the same time (no communication); the slowest rank's figure
    torch CP        torch's context_parallel for FlexAttention: _ContextParallel(FLEX) on an attention
                    module whose flex_attention is torch.compile'd (torchtitan's form; K/V gathered by
                    cplib::flex_cp_allgather), the mask and inputs dealt by its head-tail and by its
                    PTRR load balancer; its best is the faster
    commopt         the schedules the rewrite runs (flex_ring / flex_allgather, what the
                    cp_flex_attention ops call), each on the contiguous layout and on
                    torch_commopt.balance.choose's, the rank's rows' mask stated as a
                    context-parallel program states it; commopt's pick: the flex model's first
                    (tuner/attention/flex_cost.py, as the rewrite ranks) on choose's layout

Masks: causal, "docs N" (documents of mean N tokens, lengths uniform in [N/4, 7N/4], causal within),
"window N" (causal, N back).  Every variant's out and dq/dk/dv on each rank's rows are checked
against the single GPU's (relative error).  Times: benchmarks/bench_attention.py's (back-to-back
calls after a lead, median of rotated rounds, slowest rank).  efficiency = single / (W x commopt);
speedup = torch CP's best / commopt.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 -m benchmarks.bench_flex --out benchmarks/results --commit SHA [--seq 16384,32768] [--world 2]
        [--pick-only] [--profile 3]   # --profile: each variant's device time by kernel, every rank's
        [--host 10]                   # each variant's host time a call (calls queued behind a GPU sleep)
        [--pulled]                    # each one-group all-gather also with its pulled, cut K/V gather
    python3 -m benchmarks.bench_flex --cpu       # gloo smoke run: float32, 1K tokens, small heads
    python3 -m benchmarks.bench_flex --shared    # both ranks on one GPU over gloo: the GPU path, not timings
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pathlib

import torch
import torch.distributed as dist

from benchmarks.attention_timing import LEAD_CALLS, TARGET_MS, Clock, time_variants
from benchmarks.bench_attention import pick_machine
from benchmarks.common import fmt, machine_meta, result_stem, with_env, write_report
from benchmarks.probe_flex_blocks import mask_mod
from torch_commopt.testing.launch import run_distributed

log = logging.getLogger("torch_commopt.bench_flex")
PRESETS = {"gpu": {"seq": "16384,32768,65536,131072", "masks": "causal,docs 1K,docs 4K,docs 16K,window 4K",
                   "heads": (32, 8), "head_dim": 128, "dtype": torch.bfloat16},
           "cpu": {"seq": "1024", "masks": "causal,docs 256,window 256", "heads": (4, 2), "head_dim": 16,
                   "dtype": torch.float32}}
BLOCK = 128


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _flex(device: str):
    """flex_attention as a GPU program runs it (compiled), or on a CPU its eager operators (the
    only ones with a backward there; torch's CPU gradient check lifted)."""
    import torch.nn.attention.flex_attention as fa

    if device == "cuda":
        return torch.compile(fa.flex_attention, dynamic=False)
    fa._validate_device = lambda *args, **kwargs: None  # noqa: SLF001
    return fa.flex_attention


class _Case:
    """One mask and length: the whole-sequence inputs (the same on every rank), the mask, the
    single GPU's result."""

    def __init__(self, kind: str, seq: int, preset: dict, device: str, flex) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        h, h_kv = preset["heads"]
        gen = torch.Generator(device=device).manual_seed(seq)
        dtype, d = preset["dtype"], preset["head_dim"]
        self.kind, self.seq, self.flex, self.device = kind, seq, flex, device
        self.q, self.dout = (torch.randn(1, h, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        self.k, self.v = (torch.randn(1, h_kv, seq, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        self.mod = mask_mod(kind, seq, device)
        self.mask = create_block_mask(self.mod, None, None, seq, seq, device=device, BLOCK_SIZE=BLOCK)
        self.shape = (1, h, h_kv, seq, d)
        self.ref = self.fwd_bwd(self.flex, self.q, self.k, self.v, self.dout, self.mask)

    @staticmethod
    def fwd_bwd(fn, q, k, v, dout, mask) -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, block_mask=mask, enable_gqa=True)
        out.backward(dout)
        return [out.detach(), *(t.grad for t in leaves)]


def _variant(fn, *args):
    """A bench_attention.time_variants variant: a fresh context yielding (the call, None)."""

    def step():
        return fn(*args)

    return lambda: contextlib.nullcontext((step, None))


def _pulled(fn):
    """fn with the all-gather's pulled, cut K/V gather asked for (TORCH_COMMOPT_FLEX_GATHER_CUT=1)
    during its calls: the forward's gather, whose K/V one head group keeps for its backward."""
    from torch_commopt.core import env

    return with_env(fn, {env.FLEX_GATHER_CUT: "1"})


def _commopt_variants(case: _Case, rank: int, world: int, group, args: argparse.Namespace,
                      only: str | None) -> tuple[dict, dict, dict]:
    """({name: variant}, {name: errors}, {layout: tiles per rank}) of every schedule on the
    contiguous layout and on balance.choose's; `only`: that schedule on one layout alone, choose's
    or args.layout's (each schedule and layout compiles kernels of its own: minutes a case on a
    GPU).  The ops take the rank's rows' mask, or with args.whole_mask the whole sequence's."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import balance, flex_allgather, flex_ring
    from torch_commopt.tuner.attention.flex_cost import flex_candidates

    length, scale = case.seq // world, case.q.shape[-1] ** -0.5
    rows = balance.row_work(case.mask)
    contiguous = balance.contiguous(rows.numel(), world, BLOCK)
    chosen = contiguous if args.layout == "contiguous" else balance.choose(case.mask, world)
    layouts = {lay.name: lay for lay in ([chosen] if only else [contiguous, chosen])}
    variants, errors, tiles = {}, {}, {}
    for name, lay in layouts.items():
        moved = lay.mask_mod(case.mod, case.device)
        if args.whole_mask:  # every rank holds the whole sequence's mask (over layout positions)
            mine = create_block_mask(moved, None, None, case.seq, case.seq, device=case.device, BLOCK_SIZE=BLOCK)
        else:
            mine = create_block_mask(lambda b, h, q, kv, moved=moved: moved(b, h, q + rank * length, kv), None, None,
                                     length, case.seq, device=case.device, BLOCK_SIZE=BLOCK)
        local = [lay.shard(t, 2, rank).contiguous() for t in (case.q, case.k, case.v, case.dout)]
        want = [lay.shard(t, 2, rank) for t in case.ref]
        tiles[name] = lay.rank_work(rows)
        for schedule in [only] if only else flex_candidates(case.shape, False, world, own_rows=not args.whole_mask):
            groups = int(schedule.split("g=")[1]) if "g=" in schedule else 1

            def fn(q, k, v, *, block_mask, enable_gqa, schedule=schedule, groups=groups):
                if schedule == "ring":
                    return flex_ring.flex_ring(q, k, v, block_mask, scale, group)
                return flex_allgather.flex_allgather(q, k, v, block_mask, scale, group, groups)

            runs = {f"commopt {schedule} @ {name}": fn}
            if args.pulled and schedule == "allgather":  # one head group: the gather it keeps, cut
                runs[f"commopt allgather pulled @ {name}"] = _pulled(fn)
            for key, run in runs.items():
                errors[key] = max(_rel(g, w) for g, w in zip(_Case.fwd_bwd(run, *local, mine), want, strict=True))
                variants[key] = _variant(_Case.fwd_bwd, run, *local, mine)
    return variants, errors, tiles


def _torch_cp_variants(case: _Case, rank: int, world: int, mesh) -> tuple[dict, dict]:
    """torch's context_parallel (FLEX) with its head-tail and PTRR load balancers."""
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _HeadTailLoadBalancer,
        _PTRRLoadBalancer,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    flex = case.flex

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, *, block_mask=None, enable_gqa=True):
            return flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)

    attn = parallelize_module(Attention(), mesh, _ContextParallel(seq_dim=2,
                                                                  attention_type=_ContextParallel.AttentionType.FLEX))
    balancers = {"head_tail": _HeadTailLoadBalancer(case.seq, world, case.device),
                 "ptrr": _PTRRLoadBalancer(case.mask, world)}
    variants, errors = {}, {}
    for name, balancer in balancers.items():
        (mine,) = _context_parallel_shard(mesh, [case.mask], [2], load_balancer=balancer)
        local = [t.contiguous() for t in _context_parallel_shard(mesh, [case.q, case.k, case.v, case.dout], [2] * 4,
                                                                  load_balancer=balancer)]
        order = balancer._generate_indices()[0].to(case.device).view(world, -1)[rank]  # noqa: SLF001
        got = _Case.fwd_bwd(attn, *local, mine)
        errors[f"torch CP {name}"] = max(_rel(g, w.index_select(2, order)) for g, w in zip(got, case.ref, strict=True))
        variants[f"torch CP {name}"] = _variant(_Case.fwd_bwd, attn, *local, mine)
    return variants, errors


def _pick(case: _Case, world: int, dtype: torch.dtype, device: str) -> str:
    """The schedule the rewrite runs: the flex model's first at a causal mask's work, with the
    machine figures the compiled path uses (the one-group all-gather keeping its gathered K/V, as
    under the default config and in flex_allgather's autograd function)."""
    from torch_commopt.tuner.attention.flex_cost import causal_work, rank_flex_schedules

    machine, _ = pick_machine(device, world, dtype)
    return rank_flex_schedules(case.shape, causal_work(world), dtype=dtype, machine=machine, backward=True,
                               kept_gathers=True)[0][0]


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    preset = PRESETS["cpu" if args.cpu else "gpu"]
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        torch.cuda.set_device(0 if args.shared else rank)
    mesh, clock, flex = init_device_mesh(device, (world,)), Clock(device), _flex(device)
    records = []
    for seq in (int(s) for s in (args.seq or preset["seq"]).split(",")):
        for kind in (args.masks or preset["masks"]).replace("_", " ").split(","):
            # Dynamo keys torch's compiled flex_attention on the mask function's closure: every mask
            # of the sweep recompiles it, and past the recompile limit torch's variants fell back to
            # the unfused kernel (PTRR's window ran 353 ms on 2x H200).  A case starts afresh.
            torch._dynamo.reset()
            case = _Case(kind, seq, preset, device, flex)
            single = {"single GPU": _variant(_Case.fwd_bwd, case.flex, case.q, case.k, case.v, case.dout, case.mask)}
            pick = args.schedule or _pick(case, world, preset["dtype"], device)
            ours, errors, tiles = _commopt_variants(case, rank, world, dist.group.WORLD, args,
                                                    pick if args.pick_only else None)
            # on a GPU the ranks share, torch CP's eager funcol gathers over gloo crash the process
            # (tests/gpu/results/shared_gpu_funcol_segfault_h200_2026-11-25.txt): not run there
            theirs, their_errors = ({}, {}) if args.shared else _torch_cp_variants(case, rank, world, mesh)
            variants = {**single, **ours, **theirs}
            ms = time_variants(variants, clock, device, args.repeats, args.target_ms, args.lead)
            errs = torch.tensor(list({**errors, **their_errors}.values()), dtype=torch.float64, device=device)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            records.append({"mask": kind, "seq": seq, "ms": {k: sorted(v)[len(v) // 2] for k, v in ms.items()},
                            "errors": dict(zip({**errors, **their_errors}, errs.tolist(), strict=True)),
                            "tiles": tiles, "pick": pick})
            if args.profile and device == "cuda":
                records[-1]["profile"] = _profiles(variants, args.profile)
            if args.host and device == "cuda":
                records[-1]["host_ms"] = _host_ms(variants, args.host)
            if args.host_profile and device == "cuda":
                _host_profile({k: v for k, v in variants.items() if k.startswith("commopt")}, args.host_profile,
                              rank == 0)
            if rank == 0:
                log.info("%s", records[-1])
    return records


PROFILE_KERNELS = 8  # the longest kernels of each variant the report lists


def _profiles(variants: dict, calls: int) -> dict:
    """{variant: [each rank's step_profile.breakdown of `calls` calls back to back, after as many
    unprofiled ones]}: where each variant's device time goes, every rank's (the slowest sets the time)."""
    from benchmarks import step_profile

    def sync():
        torch.cuda.synchronize()
        dist.barrier()

    def measure(name, step):
        mine = step_profile.breakdown(step, sync, name, steps=calls, lead=calls)
        mine.pop("window", None)
        mine["kernels"] = dict(list(mine["kernels"].items())[:PROFILE_KERNELS])
        return mine

    return _every_rank(variants, measure)


def _every_rank(variants: dict, measure) -> dict:
    """{variant: [every rank's measure(name, step)]}, each variant's context entered for it."""
    out = {}
    for name, variant in variants.items():
        with variant() as (step, _):
            mine = measure(name, step)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[name] = every
    return out


HOST_SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU sleep at H200 clocks: far longer than the calls' enqueue


def _behind_sleep(step) -> None:
    """One warm call of `step` (caches, lazy inits), every rank at rest, then a GPU sleep queued:
    calls queued after it cost the host only (the GPU is busy far longer than their enqueue)."""
    step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(HOST_SLEEP_CYCLES)  # noqa: SLF001


def _host_ms(variants: dict, calls: int) -> dict:
    """{variant: [each rank's host ms a call]}: `calls` calls queued behind a GPU sleep, so the
    host never waits for the GPU and the time to queue them is the host's alone (where a variant
    takes longer to queue than the GPU to run, the call is the host's, whatever its kernels)."""
    import time

    def measure(name, step):
        _behind_sleep(step)
        start = time.perf_counter()
        for _ in range(calls):
            step()
        ms = (time.perf_counter() - start) * 1e3 / calls
        torch.cuda.synchronize()
        return ms

    return _every_rank(variants, measure)


def _host_profile(variants: dict, calls: int, show: bool, top: int = 45) -> None:
    """Where this rank's host time goes in `calls` calls of each variant, queued behind a GPU sleep
    as in _host_ms (cProfile, by own and by cumulative time; printed where `show`): for finding
    the Python a host-bound call spends, not a figure of the report."""
    import cProfile
    import io
    import pstats

    for name, variant in variants.items():
        with variant() as (step, _):
            _behind_sleep(step)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                step()
            prof.disable()
            torch.cuda.synchronize()
        for order in ("tottime", "cumulative") if show else ():
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
            print(f"== host profile of {name}, {calls} calls, by {order}\n{text.getvalue()}")


def host_lines(records: list[dict]) -> list[str]:
    """The report's section on each variant's host time a call (--host), every rank's."""
    lines = [f"- {r['mask']} S {r['seq']}: " + "; ".join(f"{name} {' / '.join(f'{v:.2f}' for v in ranks)}"
                                                      for name, ranks in r["host_ms"].items())
             for r in records if r.get("host_ms")]
    return (["", "## Host ms a call, by rank (--host: calls queued behind a GPU sleep)", "", *lines]) if lines else []


def profile_lines(records: list[dict]) -> list[str]:
    """The report's section on each profiled variant's device time, per rank."""
    lines = []
    for r in records:
        if not r.get("profile"):
            continue
        lines += ["", f"### {r['mask']}, S {r['seq']}: device ms a call, by rank", ""]
        for name, ranks in r["profile"].items():
            for rank, prof in enumerate(ranks):
                cats = ", ".join(f"{k} {v}" for k, v in prof.items() if isinstance(v, float))
                top = "; ".join(f"{k} {v[0]} (x{v[1]:g})" for k, v in prof["kernels"].items())
                idle = prof.get("idle_gaps", {})
                lines.append(f"- {name}, rank {rank}: {cats}; idle {idle.get('idle_ms')} ms in {idle.get('gaps')} gaps; "
                             f"longest kernels: {top}")
    return (["", "## Where each call's device time goes (--profile)"] + lines) if lines else []


def derive(records: list[dict], world: int) -> list[dict]:
    """Per record: commopt's pick time (choose's layout), its efficiency and speedup over torch CP's best."""
    for r in records:
        ms = r["ms"]
        layout = [k for k in r["tiles"] if k != "contiguous"] or ["contiguous"]
        r["layout"] = layout[0]
        r["commopt_ms"] = ms[f"commopt {r['pick']} @ {r['layout']}"]
        r["best_commopt"] = min((k for k in ms if k.startswith("commopt")), key=ms.get)
        cp = [ms[k] for k in ms if k.startswith("torch CP")]
        r["torch_cp_ms"] = min(cp) if cp else None
        r["efficiency"] = ms["single GPU"] / (world * r["commopt_ms"])
        r["torch_cp_efficiency"] = ms["single GPU"] / (world * r["torch_cp_ms"]) if cp else None
        r["speedup_vs_torch_cp"] = r["torch_cp_ms"] / r["commopt_ms"] if cp else None
    return records


def report(records: list[dict], meta: dict) -> str:
    lines = [f"# FlexAttention context parallelism over {meta['world']} ranks ({meta['device']})", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; {meta['dtype']}, B 1, H/H_kv "
             f"{meta['heads']}, D {meta['head_dim']}, forward + backward; ms per call, median of {meta['repeats']} "
             "rounds, slowest rank. efficiency = single GPU / (W x ms). commopt: its pick on balance.choose's layout "
             "(the layout in the table)" + ("; K/V moved by the copy engine (ce_gather)" if meta.get("transport") == "ce"
                                            else "")
             + (", the whole sequence's mask" if meta.get("whole_mask") else ", the rank's rows' mask")
             + "; torch CP: the faster of its head-tail and PTRR balancers.", "",
             "| mask | S_total | single GPU ms | commopt pick | layout | commopt ms | efficiency | torch CP ms "
             "| torch CP efficiency | speedup vs torch CP | fastest commopt | max rel error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['mask']} | {r['seq']} | {fmt(r['ms']['single GPU'])} | {r['pick']} | {r['layout']} | "
                     f"{fmt(r['commopt_ms'])} | {fmt(r['efficiency'], 2)} | {fmt(r['torch_cp_ms'])} | "
                     f"{fmt(r['torch_cp_efficiency'], 2)} | {fmt(r['speedup_vs_torch_cp'], 2)} | "
                     f"{r['best_commopt']} ({fmt(r['ms'][r['best_commopt']])}) | {max(r['errors'].values()):.1e} |")
    lines += ["", "## Every variant (ms; tiles per rank by layout)", ""]
    for r in records:
        cells = ", ".join(f"{k} {fmt(v)}" for k, v in r["ms"].items())
        lines.append(f"- {r['mask']} S {r['seq']}: {cells}; tiles {r['tiles']}")
    return "\n".join(lines + host_lines(records) + profile_lines(records)) + "\n"


def report_variant(args: argparse.Namespace) -> str:
    """The report's name suffix for a run off the defaults (e.g. "ring_contiguous_whole"): each
    such run is a report of its own beside the default one."""
    parts = [args.schedule and args.schedule.replace(":", "-").replace("=", ""),
             args.layout if args.layout != "choose" else None, "whole" if args.whole_mask else None,
             "pulled" if args.pulled else None, None if _moves_by_copy_engine() else "nccl"]
    return "_".join(p for p in parts if p)


def _moves_by_copy_engine() -> bool:
    """Whether commopt's all-gather moves K/V on the copy engine in this run (TORCH_COMMOPT_ATTENTION_TRANSPORT
    auto, the default, or ce); with nccl a report of its own beside the default one."""
    from torch_commopt.kernels.attention import ce_ring

    return ce_ring.transport() != "nccl"


def join(paths: list[str], out: str | None) -> str:
    """One report of several runs' JSON reports (e.g. one S_total a device call): their records in
    the order given, the first's fields, each run's commit and command kept; written to `out`
    under the first's name."""
    import json

    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    if len({(r["device"], r["world"], r.get("transport", "nccl")) for r in runs}) != 1:
        raise SystemExit("bench_flex --join: the reports differ in device, world or transport")
    meta = {k: v for k, v in runs[0].items() if k != "records"}
    meta["commit"] = "/".join(dict.fromkeys(r["commit"] for r in runs))
    meta["command"] = " ; ".join(r["command"] for r in runs)
    meta["repeats"] = "/".join(dict.fromkeys(str(r["repeats"]) for r in runs))
    records = [rec for r in runs for rec in r["records"]]
    text = report(records, meta)
    if out:
        name = pathlib.Path(paths[0]).stem
        write_report(pathlib.Path(out), name, {**meta, "records": records}, text)
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="gloo smoke run: float32, 1K tokens, small heads")
    p.add_argument("--shared", action="store_true", help="both ranks on one GPU over gloo: a check of the GPU path")
    p.add_argument("--seq", help="comma-separated S_total values")
    p.add_argument("--masks", help="comma-separated masks: causal, docs N, window N ('_' for a space: docs_4K)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--target-ms", dest="target_ms", type=float, default=None)
    p.add_argument("--lead", type=int, default=LEAD_CALLS)
    p.add_argument("--pick-only", dest="pick_only", action="store_true",
                   help="commopt's pick on balance.choose's layout alone (not every schedule on both layouts)")
    p.add_argument("--schedule", default=None, help="commopt's schedule in place of the flex model's pick")
    p.add_argument("--layout", choices=("choose", "contiguous"), default="choose",
                   help="the layout of --pick-only (and the second layout of the full sweep)")
    p.add_argument("--whole-mask", dest="whole_mask", action="store_true",
                   help="commopt's ops take the whole sequence's mask, not the rank's rows' (torch CP's form): the "
                        "ring then sends each rank only the span of keys it needs (flex_ring.DirectShift)")
    p.add_argument("--pulled", action="store_true",
                   help="beside each one-group all-gather, the same with its K/V gather pulled and cut to the keys "
                        "the rank's rows keep and its dK/dV reduce-scatter cut to their gradients "
                        "(TORCH_COMMOPT_FLEX_GATHER_CUT=1, experimental; two ranks, copy engine)")
    p.add_argument("--profile", type=int, default=0, metavar="CALLS",
                   help="after the timing, each variant's device time by kernel on every rank: CALLS calls profiled "
                        "back to back behind as many unprofiled ones (step_profile.breakdown)")
    p.add_argument("--host", type=int, default=0, metavar="CALLS",
                   help="after the timing, each variant's host time a call: CALLS calls queued behind a GPU sleep")
    p.add_argument("--host-profile", dest="host_profile", type=int, default=0, metavar="CALLS",
                   help="after the timing, rank 0 prints a cProfile of commopt's variants' host work over CALLS calls")
    p.add_argument("--join", nargs="+", metavar="JSON", help="write one report of these runs' reports to --out")
    p.add_argument("--commit", default="")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.cpu else 5)
    args.target_ms = args.target_ms or (1.0 if args.cpu else TARGET_MS)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.join:
        print(join(args.join, args.out))
        return []
    from torch_commopt.core import env

    if args.shared:
        os.environ[env.SHARED_DEVICE] = "1"  # the ranks take this process's environment
    records = run_distributed(worker, args.world, args, backend="gloo" if args.cpu or args.shared else "nccl",
                              timeout_s=3600)[0]
    preset = PRESETS["cpu" if args.cpu else "gpu"]
    device = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(0) + (" shared by the ranks" if args.shared else "")
    meta = machine_meta(device, args.world, args.commit,
                        dtype=str(preset["dtype"]).removeprefix("torch."), heads="/".join(map(str, preset["heads"])),
                        head_dim=preset["head_dim"], repeats=args.repeats,
                        whole_mask=args.whole_mask, layout=args.layout, schedule=args.schedule,
                        transport="ce" if _moves_by_copy_engine() else "nccl")
    text = report(derive(records, args.world), meta)
    if args.out and not args.shared:  # a shared GPU's times are no figures
        write_report(pathlib.Path(args.out), result_stem("flex_cp", meta["device"], args.world, meta["date"],
                                                         report_variant(args)),
                     {**meta, "records": records}, text)
    print(text)
    return records


if __name__ == "__main__":
    main()
