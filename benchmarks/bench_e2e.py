"""End-to-end training steps of a Llama-3-8B-shaped stack: inductor, inductor + async-TP, commopt.

A few Llama-3-8B layers (dim 4096, 32 heads / 8 KV heads, SwiGLU hidden 14336; no RoPE and no
embedding: the input is a random activation, the loss the MSE to a fixed random target), each
block parallelized with DTensor TP + sequence parallelism (torchtitan's plan, models.tp_sp_plan)
and compiled on its own as torchtitan does, trained with AdamW (fused on CUDA, torchtitan's
default) in bf16 from the same seed:

    inductor            block.compile() (NCCL collectives + cuBLAS)
    inductor+async-TP   the same with torch._inductor.config._micro_pipeline_tp and symmetric
                        memory enabled for the TP group (PyTorch's async-TP)
    commopt             torch_commopt.optimize(block) (the built-in rule)
    commopt model       torch_commopt.optimize(block, mode="model") (cost model + plan search;
                        the machine is calibrated first)
    inductor+cudagraphs block.compile(options={"triton.cudagraphs": True}): replayed from CUDA
                        graphs (Inductor's CUDA-graph trees), no per-kernel host cost
    commopt graphs      torch_commopt.optimize(block, cuda_graphs=True): the same for commopt
                        (its schedules' per-call host cost goes too)
(--variants also takes "commopt no concat-K", "commopt model no concat-K", "commopt band timed", "commopt k parts",
"commopt band training" and "commopt model graphs"; "_" may stand for a space.)  And a bound, not a backend:

    inductor comm-free  the inductor variant with every collective taken out of its compiled
                        graphs (benchmarks/comm_free.py: gathers read a constant of their shape,
                        reduce-scatters keep their first rows): the step's computation alone,
                        the best that hiding all of its communication could reach on these GPUs.
                        Its losses are meaningless and not compared.
    inductor sync-only  the same with a one-element all-reduce where each collective was: the
                        ranks meet at every exchange and move no bytes (what meeting costs).

Per variant: the loss of every step (the curves must agree within bf16 noise), step time
(median over rounds, slowest rank, of --burst steps run back to back with one synchronize at
the end, as a training loop runs them; and of one step synchronized on its own; every variant
is built and warmed up first, then timed in turns, the order rotated each round, so all see
the same clocks),
tokens/s (batch x seq per step over the TP group), peak memory (its own), the GPU clocks
while its steps ran, and a device-time breakdown per step of --profile-steps steps profiled
back to back on rank 0 (GEMM, attention, NCCL, commopt/Triton kernels, copies to the peer,
other copies, other), after --profile-lead unprofiled steps queued just before them (0: they
start from an idle GPU), with the GPU clocks sampled while they ran.  Writes
e2e_h200x<W>_<date>.json/.md:

    python3 benchmarks/bench_e2e.py --out DIR [--commit SHA] [--layers 4] [--seq 8192] [--steps 20]
                                    [--repeats 20] [--burst 5] [--profile-steps 3] [--profile-lead 5]
                                    [--host-profile 5]  # cProfile of the host's enqueue per variant
    python3 benchmarks/bench_e2e.py --cpu     # gloo smoke run, tiny shapes, no figures
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import re
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import comm_free  # noqa: E402
from benchmarks.common import result_stem, with_env, write_report  # noqa: E402
from benchmarks.compiled_variants import allow_entries, check_unchanged, compile_counts  # noqa: E402
from benchmarks.gpu_clocks import ClockSampler  # noqa: E402
from benchmarks.render_e2e import COMM_FREE, SYNC_ONLY, VARIANT_ENV, records, report  # noqa: E402
from benchmarks.step_profile import breakdown  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402
from torch_commopt.testing.validate import check_shape  # noqa: E402

VARIANTS = ["inductor", "inductor+async-TP", "commopt", "commopt model", "inductor+cudagraphs", "commopt graphs"]
# commopt variants' optimize() options; "... no concat-K" (not run by default) isolates what
# folding the backward's sums of matmuls into one reduce-scatter region brings
COMMOPT_OPTIONS = {"commopt": {}, "commopt model": {"mode": "model"},
                   # each region's candidates timed at its first call (one of the loss-curve steps)
                   "commopt autotune": {"mode": "autotune"},
                   "commopt no concat-K": {"concat_k": False},
                   # short regions' eager calls replayed from per-call CUDA graphs (Config.call_graphs)
                   "commopt call-graphs": {"call_graphs": True},
                   # every region's eager calls replayed from per-call CUDA graphs (opt-in)
                   "commopt call-graphs all": {"call_graphs": "all"},
                   # graphs estimated host-bound (the forward's) left to Inductor (opt-in)
                   "commopt host-bound inductor": {"host_bound_graphs": "inductor"},
                   # the band's regions always timed at their first call
                   "commopt band timed": {"band_in_graph": False},
                   # a training forward's band ranked with its backward counted (opt-in)
                   "commopt band training": {"band_in_graph": "training"},
                   # concat-K's terms handed to the ops as K parts (Config.k_parts, off by default)
                   "commopt k parts": {"k_parts": True},
                   "commopt model no concat-K": {"mode": "model", "concat_k": False},
                   # replayed from CUDA graphs (Inductor's CUDA-graph trees): no per-call host cost
                   "commopt graphs": {"cuda_graphs": True},
                   "commopt model graphs": {"mode": "model", "cuda_graphs": True},
                   # the GPU-wait watchdog off around its steps (what the watchdog costs a step)
                   "commopt watchdog off": {},
                   # every eager GPU-schedule call through its Python host code (no native host replay)
                   "commopt python host": {},
                   # a call's token writes to its peers from the side stream (env.TOKENS_ON_SIDE)
                   "commopt tokens on side": {},
                   # a kept gather's own rows copied under the own shard's GEMM (env.GATHER_OWN_EARLY)
                   "commopt own rows early": {}}
# Inductor's own compile options of the baseline variants (and of the comm-free bound)
INDUCTOR_OPTIONS = {"inductor": {}, "inductor+async-TP": {}, "inductor+cudagraphs": {"triton.cudagraphs": True},
                    COMM_FREE: comm_free.OPTIONS, SYNC_ONLY: comm_free.SYNC_OPTIONS}
BOUNDS = (COMM_FREE, SYNC_ONLY)  # no data moved: their losses are not compared
class Stack(torch.nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        from torch_commopt.testing.models import LlamaBlock

        self.layers = torch.nn.ModuleList(LlamaBlock(dim, heads, hidden, kv_heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x


def build(variant: str, shape: dict, dev: str) -> Stack:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import torch_commopt
    from torch_commopt.testing.models import tp_sp_plan

    torch.manual_seed(0)
    model = Stack(shape["layers"], shape["dim"], shape["heads"], shape["kv_heads"], shape["hidden"])
    model = model.to(device=dev, dtype=torch.bfloat16)
    mesh = init_device_mesh(dev, (dist.get_world_size(),))
    for block in model.layers:
        parallelize_module(block, mesh, tp_sp_plan(block))
        # dynamic=False: the blocks share one forward, and a recompile for the next block would
        # otherwise turn on automatic dynamic shapes (which DTensor's rms_norm does not take)
        if variant.startswith("commopt"):
            torch_commopt.optimize(block, dynamic=False, **COMMOPT_OPTIONS[variant])
        else:
            block.compile(dynamic=False, options=INDUCTOR_OPTIONS[variant] or None)
    return model


def inputs(shape: dict, world: int, rank: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (input, target) sequence shards, bf16, the same on every run."""
    b, s, d = shape["batch"], shape["seq"], shape["dim"]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, d, generator=gen).chunk(world, dim=1)[rank].to(dev, torch.bfloat16)
    target = torch.randn(b, s, d, generator=gen).chunk(world, dim=1)[rank].to(dev, torch.bfloat16)
    return x, target


def _async_tp(on: bool) -> None:
    torch._inductor.config._micro_pipeline_tp = on
    if on:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(dist.group.WORLD.group_name)


def worker(rank: int, world: int, shape: dict, steps: int, repeats: int, variants: list[str],
           host_profile: int = 0, burst: int = 5, profile_steps: int = 3, profile_lead: int = 0) -> dict:
    """Every variant built, compiled and trained `steps` steps (its loss curve) in turn, all kept;
    then their steps timed in turns, `repeats` rounds with the order rotated each round, so
    every variant sees the same GPU clocks and temperatures (timed one after the other, the
    variant timed first ran ~2% faster on the power-capped GPUs); each turn one step on its own
    (synchronized before and after) and then `burst` steps back to back; then `profile_steps`
    profiled steps back to back each (after `profile_lead` unprofiled ones, no synchronize
    between), with the GPU clocks sampled."""
    import torch_commopt

    dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    b, s = shape["batch"], shape["seq"]
    x, target = inputs(shape, world, rank, dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out: dict = {}
    prepared: dict = {}
    # The variants' blocks share one forward code object and keep their compiled entries: one
    # reset, and a recompile limit above what they need that fails loudly (compiled_variants)
    torch._dynamo.reset()
    allow_entries(len(variants) * shape["layers"])
    for variant in variants:
        if variant == "inductor+async-TP" and dev != "cuda":
            out[variant] = {"skipped": "async-TP needs CUDA symmetric memory"}
            continue
        torch_commopt.reset_explain()
        _async_tp(variant == "inductor+async-TP")
        if dev == "cuda":
            sync()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        model = build(variant, shape, dev)
        step = _train_step(model, x, target, fused=dev == "cuda")
        if variant in VARIANT_ENV:
            step = with_env(step, VARIANT_ENV[variant])
        losses = []
        # the blocks compile at their first call: the bound's pass must be installed then
        with comm_free.installed(variant == SYNC_ONLY) if variant in BOUNDS else contextlib.nullcontext():
            for _ in range(steps):  # the loss curve (the first steps also compile and warm up)
                loss = step()
                dist.all_reduce(loss)
                losses.append(loss.item() / world)
        rec = {"losses": losses,  # its own memory: what the variants built before it hold is not counted
               "peak_mem_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else None}
        if variant in BOUNDS:
            rec["bound"], rec["comm_free"] = variant == COMM_FREE, comm_free.stats(variant == SYNC_ONLY)
            rec["sync_only"] = variant == SYNC_ONLY
            if not comm_free.valid(rec["comm_free"]):  # reported, the rest runs
                print(f"rank {rank} bench_e2e {variant}: NOT a bound, collectives left: {rec['comm_free']}",
                      flush=True)
        if variant.startswith("commopt"):
            graphs = torch_commopt.explain().graphs
            rec["regions"] = sorted({f"{g.graph_kind} {r.kind}: {r.schedule}" for g in graphs for r in g.regions})
            rec["notes"] = sorted({n for g in graphs for n in g.notes + g.plan})[:40]
            rec["band_notes"] = band_notes([n for g in graphs for n in g.notes])
        _async_tp(False)
        out[variant], prepared[variant] = rec, step
    compiled = compile_counts()
    names = list(prepared)
    times: dict = {v: [] for v in names}
    isolated: dict = {v: [] for v in names}
    burst_enqueue: dict = {v: [] for v in names}  # per step, until the burst's last step() returned
    enqueue: dict = {v: [] for v in names}
    windows: dict = {v: [] for v in names}
    with ClockSampler(period_ms=50, enabled=dev == "cuda" and rank == 0) as clocks:  # every GPU, from rank 0
        for r in range(repeats):
            for variant in names[r % len(names):] + names[:r % len(names)]:
                dist.barrier()
                sync()
                w0, t0 = time.time(), time.perf_counter()
                prepared[variant]()
                enqueue[variant].append((time.perf_counter() - t0) * 1e3)  # the host's share: step() returns
                sync()
                isolated[variant].append((time.perf_counter() - t0) * 1e3)
                # then `burst` steps back to back, one synchronize at the end, as a training loop
                # runs them (torchtitan reads the loss every log_freq = 10 steps): the host
                # enqueues the next step while the GPUs finish this one
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(burst):
                    prepared[variant]()
                burst_enqueue[variant].append((time.perf_counter() - t0) * 1e3 / burst)
                sync()
                times[variant].append((time.perf_counter() - t0) * 1e3 / burst)
                windows[variant].append((w0, time.time()))
    per_variant_clocks = clocks.summary(windows) if clocks.enabled else {}
    medians = torch.tensor([[statistics.median(times[v]) for v in names],
                            [statistics.median(isolated[v]) for v in names]], dtype=torch.float64, device=dev)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
    ms, iso = medians.tolist()
    iso_ms = dict(zip(names, iso))
    for variant, t in zip(names, ms):
        out[variant].update(step_ms=t, step_ms_spread=[min(times[variant]), max(times[variant])],
                            step_ms_all=times[variant], step_ms_isolated=iso_ms[variant],
                            step_ms_isolated_all=isolated[variant],
                            host_enqueue_ms=statistics.median(enqueue[variant]),
                            burst_enqueue_ms=statistics.median(burst_enqueue[variant]),
                            tokens_per_s=b * s / (t / 1e3), gpu_clocks=per_variant_clocks.get(variant, {}))
    profile_windows: dict = {v: [] for v in names}
    with ClockSampler(period_ms=20, enabled=dev == "cuda" and rank == 0) as profile_clocks:
        for variant in names:
            dist.barrier()  # the ranks start each profiled step together: the last one's profile
            sync()          # processing takes each rank its own time (else its NCCL waits are counted)
            if dev == "cuda":  # every rank runs the profiled step (collectives); rank 0's figures kept
                got = breakdown(prepared[variant], sync, variant, steps=profile_steps, lead=profile_lead)
                profile_windows[variant].append(got.pop("window"))
                if rank == 0:
                    out[variant]["breakdown_ms"] = got
    if profile_clocks.enabled:  # the lead steps fall in the window too
        for variant, c in profile_clocks.summary(profile_windows).items():
            out[variant]["profile_gpu_clocks"] = c
    for variant in names:
        dist.barrier()
        if host_profile and rank == 0:
            out[variant]["host_profile"] = _host_profile(prepared[variant], sync, host_profile)
        elif host_profile:  # the same steps, unprofiled (collectives)
            for _ in range(host_profile):
                prepared[variant]()
            sync()
    check_unchanged(compiled, "bench_e2e")
    if dev == "cuda":  # per-call graphs over the whole run (every variant): eager, captured, replayed, dropped
        from torch_commopt.kernels.gpu import call_graphs, host_replay

        print(f"rank {rank} call_graphs {call_graphs.stats()} moved {call_graphs.moves()}", flush=True)
        print(f"rank {rank} host replay {host_replay.STATS}; not replayed: {host_replay.refusals()}", flush=True)
    return out


def _train_step(model, x: torch.Tensor, target: torch.Tensor, fused: bool = False):
    """One AdamW training step of `model` on (x, target); returns the loss (a device tensor).
    fused: the fused AdamW kernel (torchtitan's default, CUDA), else the foreach one."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused else {"foreach": True}))

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration for CUDA-graph trees (else a no-op)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def _host_profile(step, sync, steps: int, top: int = 30) -> list[str]:
    """Where the host's time goes while it enqueues `steps` steps back to back (cProfile on
    this rank; the other ranks run the same steps unprofiled): the functions with the most
    own time, as 'own ms per step | cumulative ms per step | calls per step | function'."""
    import cProfile
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [f"{tt / steps * 1e3:8.3f} | {ct / steps * 1e3:8.3f} | {nc / steps:7.1f} | "
            f"{pathlib.Path(f).name}:{line}({name})" for (f, line, name), (_, nc, tt, ct, _) in rows]


BAND_NOTES = ("autotune measured", "graph: est.", "ranked by GPU time")


def band_notes(notes: list[str]) -> list[str]:
    """The explain notes that tell how the host-bound band was decided: each graph's host /
    GPU estimate (passes/host_ahead.py), the regions ranked by GPU time, and each first-call
    timing with its host enqueue figures."""
    return sorted({n for n in notes if any(k in n for k in BAND_NOTES)})


TIMELINE = ("commopt", "inductor")  # the step picture's variants, drawn in this order, top down


def timeline_picture(trace_dir, variants: list[str], out_dir, stem: str) -> str | None:
    """The step picture (torch_commopt/timeline.py) of commopt's and inductor's traced steps on
    rank 0 (step_profile writes them under COMMOPT_TRACE_DIR), as `<stem>_timeline.png` and `.html`
    in out_dir: the PNG's file name, or None with the reason printed (a variant not run, a trace
    missing, no matplotlib)."""
    from torch_commopt import timeline

    labels = [v for v in TIMELINE if v in variants]
    paths = [pathlib.Path(trace_dir) / f"{re.sub(r'[^A-Za-z0-9]+', '_', v)}_rank0.json" for v in labels]
    missing = [str(path) for path in paths if not path.exists()]
    if len(labels) < len(TIMELINE) or missing:
        print(f"no step picture: it needs the variants {list(TIMELINE)} and their traces (missing: {missing})")
        return None
    png = pathlib.Path(out_dir) / f"{stem}_timeline.png"
    try:
        timeline.render([timeline.load(str(path), v) for path, v in zip(paths, labels)], png, png.with_suffix(".html"))
    except RuntimeError as e:
        print(f"no step picture: {e}")
        return None
    return png.name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=3,
                   help="steps profiled back to back per variant for the breakdown (its figures per step)")
    p.add_argument("--profile-lead", dest="profile_lead", type=int, default=5,
                   help="unprofiled steps queued right before the profiled ones (no synchronize between), so "
                        "these run as inside a training loop, at the GPU's sustained clocks (0: from an idle "
                        "GPU: on 2x H200 that profiled commopt at 44.9 ms a step where its timed bursts ran "
                        "48.6)")
    p.add_argument("--burst", type=int, default=5,
                   help="steps run back to back per turn (one synchronize at the end): the step time reported")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--commit", default="")
    p.add_argument("--tag", default="", help="appended to the report's name: a run of other variants than the "
                   "comparison's (e.g. 'watchdog' for commopt with the watchdog on and off) keeps its own report")
    p.add_argument("--host-profile", dest="host_profile", type=int, default=0, metavar="STEPS",
                   help="cProfile STEPS steps on rank 0 per variant: the host's own time by function")
    p.add_argument("--cpu", action="store_true", help="gloo smoke run with tiny shapes; prints, writes nothing")
    p.add_argument("--timeline", action="store_true",
                   help="trace one more step of each variant (under OUT/traces) and put the picture of commopt's "
                        "and inductor's in the report (<report>_timeline.png / .html beside it)")
    args = p.parse_args()
    if args.cpu:  # head dim 16, two query heads and one kv head per rank
        args.heads, args.kv_heads = 2 * args.world, args.world
        args.layers, args.seq, args.dim, args.hidden = 2, 8 * args.world, 16 * args.heads, 32 * args.heads
        args.steps, args.repeats, args.burst = 3, 2, 2
    shape = {"layers": args.layers, "batch": args.batch, "seq": args.seq, "dim": args.dim, "heads": args.heads,
             "kv_heads": args.kv_heads, "hidden": args.hidden}
    try:  # before any rank starts: a clear error instead of a view failure inside the ranks
        check_shape("tp_sp_block", shape, args.world)
    except ValueError as e:
        p.error(str(e))
    # "_" stands for a space ("commopt_model"): BENCH_ARGS reaches the script word-split
    variants = [v.strip().replace("_", " ") for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in INDUCTOR_OPTIONS and v not in COMMOPT_OPTIONS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {sorted(set(INDUCTOR_OPTIONS) | set(COMMOPT_OPTIONS))}")
    backend = "gloo" if args.cpu else "nccl"
    if any(COMMOPT_OPTIONS.get(v, {}).get("mode") == "model" for v in variants):
        from torch_commopt.cli import run_calibration

        print(run_calibration(args.world, backend), flush=True)
    trace_dir = pathlib.Path(args.out) / "traces"
    if args.timeline and not args.cpu:  # read by step_profile.breakdown in the ranks (their env is this one's)
        os.environ["COMMOPT_TRACE_DIR"] = str(trace_dir)
    res = run_distributed(worker, args.world, shape, args.steps, args.repeats, variants, args.host_profile, args.burst,
                          args.profile_steps, args.profile_lead,
                          backend=backend,
                          timeout_s=1500)[0]
    rows = records(res, shape, args.world)
    if args.cpu:
        print(json.dumps(rows, indent=1))
        return
    date = datetime.date.today().isoformat()
    meta = {"device": torch.cuda.get_device_name(0), "world": args.world, "date": date, "torch": torch.__version__,
            "commit": args.commit, "shape": shape, "steps": args.steps, "repeats": args.repeats, "burst": args.burst,
            "profile_steps": args.profile_steps, "profile_lead": args.profile_lead,
            "command": "python3 " + " ".join(sys.argv)}
    stem = result_stem("e2e", meta["device"], args.world, date,
                       variant=f"b{args.batch}s{args.seq}" + (f"_{args.tag}" if args.tag else ""))
    text = report(rows, meta)
    picture = timeline_picture(trace_dir, variants, args.out, stem) if args.timeline else None
    if picture:
        text += (f"\n\n## One step, commopt above and inductor below (rank 0, one time scale)\n\n![the step's "
                 f"GPU lanes, commopt and inductor]({picture})\n")
    write_report(args.out, stem, {"meta": meta, "records": rows, "raw": res, "timeline": picture}, text)
    print(text)


if __name__ == "__main__":
    main()
