"""MoE layers with expert parallelism: torchtitan's EP against commopt's exchange schedules.

One MoE layer of torchtitan 0.2.2 (router, top-k, grouped experts, shared experts as the model
has them) trained fwd+bwd in bf16 at the shapes of DeepSeek-V2-Lite, Qwen3-30B-A3B and
Mixtral-8x7B (hidden size, expert FFN size, experts, top-k), T tokens a rank, balanced or skewed
routing.  The variants, in alternating order each round, all with the layer's children other than
the experts compiled by Inductor as torchtitan compiles them:
- `torchtitan EP`: torchtitan's ExpertParallel (all-to-alls, host read of the splits);
- `commopt a2a`, `commopt by_peer`, `commopt by_expert`, `commopt auto`: commopt's schedules
  swapped in (kernels/moe/module.py; by_expert's exchange by the copy engine on GPUs, auto the
  tuner's pick); `commopt by_expert nccl`: by_expert with its exchange on NCCL; `commopt sync_free`
  (asked for by --variants): no host read of the counts, equal blocks of a capacity (fixed per case);
- `comm-free`: the same layer with the exchange removed.  Each rank runs its local experts over
  its own tokens, with the per-expert rows an exchange would bring it on balanced routing.  This is
  the bound that hiding the exchange can reach.

The layer's input x needs its gradient, as in a model (every MoE layer's input but the first
layer's is an activation), so every variant's backward computes and sends home the input
gradients.

Per case: each variant's ms (median over rounds of the mean of back-to-back steps, slowest rank),
speedup over torchtitan's EP, the share of the exposed exchange hidden ((t_tt - t) / (t_tt - t_free)),
and the largest relative error of the output and of the input's gradient against torchtitan's EP.

`--pieces` (one GPU, one process): what pipelining costs the experts' compute, i.e. the SwiGLU
grouped GEMMs fwd+bwd over a rank's received rows whole against in the pieces a schedule runs (by
source: by_peer; by expert chunk: by_expert).

    python3 -m benchmarks.bench_moe --out OUT [--world 2] [--tokens 8192 ...]   # W GPUs (NCCL)
    python3 -m benchmarks.bench_moe --out OUT --pieces                         # one GPU
    python3 -m benchmarks.bench_moe --cpu                                      # gloo smoke, tiny shapes
    python3 -m benchmarks.bench_moe --out OUT --graph                          # decoding sizes, CUDA graphs
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from benchmarks.common import fmt, machine_meta, max_over_ranks, result_stem, write_report
from torch_commopt.core.moe_spec import parse_moe_schedule

# name -> (dim, expert FFN size, experts, top-k, shared experts)
MODELS = {
    "dsv2-lite": (2048, 1408, 64, 6, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "mixtral-8x7b": (4096, 14336, 8, 2, 0),
}
CPU_MODELS = {"tiny": (64, 48, 8, 2, 1)}
VARIANTS = ("torchtitan EP", "commopt a2a", "commopt by_peer", "commopt by_expert", "commopt by_expert nccl",
            "commopt auto", "commopt sync_free", "comm-free")
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "commopt sync_free")  # its buffers are the worst case's: asked for


def _transport(variant: str) -> None:
    """by_expert's transport for `variant` (TORCH_COMMOPT_MOE_TRANSPORT, read at every call):
    NCCL for the "... nccl" variant, else the default (the copy engine on GPUs)."""
    import os

    from torch_commopt.core import env

    if variant.endswith(" nccl"):
        os.environ[env.MOE_TRANSPORT] = "nccl"
    else:
        os.environ.pop(env.MOE_TRANSPORT, None)


def _layer(model: tuple, device, dtype, seed: int, compile_children: bool):
    import torch
    from torchtitan.models.moe import MoE, MoEArgs

    dim, hidden, experts, top_k, shared = model
    args = MoEArgs(num_experts=experts, num_shared_experts=shared, top_k=top_k, score_func="softmax",
                   score_before_experts=False, use_grouped_mm=True)
    torch.manual_seed(seed)
    with torch.device(device):
        layer = MoE(args, dim=dim, hidden_dim=hidden)
    with torch.no_grad():
        layer.init_weights(0.02, device)
    layer = layer.to(dtype)
    if compile_children:  # as torchtitan's apply_compile: every child but the experts
        for name, child in layer.named_children():
            if name != "experts":
                setattr(layer, name, torch.compile(child, fullgraph=True))
    return layer


def _free_forward(layer, world: int):
    """The comm-free bound's experts forward: the local experts over this rank's own rows, with the
    rows per local expert an exchange would bring on balanced routing (all ranks' tokens for an
    expert, as many as this rank's tokens for all of its experts' share)."""
    import torch

    from torch_commopt.kernels.moe.module import torchtitan_local

    run = torchtitan_local(layer.experts)
    experts = layer.experts

    def forward(routed_input, num_tokens_per_expert):
        nl = experts.w1.to_local().shape[0] if hasattr(experts.w1, "to_local") else experts.w1.shape[0]
        total = routed_input.shape[0]
        per = torch.full((nl,), total // nl, dtype=num_tokens_per_expert.dtype, device=routed_input.device)
        per[: total % nl] += 1
        return run(routed_input, per)

    return torch.compiler.disable(forward)


def ep_setup(world: int):
    """(cuda, device, dtype, EP mesh) of this rank: bf16 on its GPU, or float32 on the CPU with
    torchtitan's MoE shimmed for it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from torch_commopt.testing.optional import torchtitan_moe_cpu_shims

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torchtitan_moe_cpu_shims()
    return cuda, device, torch.bfloat16 if cuda else torch.float32, init_device_mesh(device.type, (world,),
                                                                                     mesh_dim_names=("ep",))


def _rank(rank: int, world: int, models: dict, cases: tuple, rounds: int, steps: int, compile_children: bool,
          variants: tuple = DEFAULT_VARIANTS):
    """cases: (tokens_list, routings)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from torch_commopt.kernels.moe import sync_free
    from torch_commopt.kernels.moe.module import swap_expert_parallel
    from torch_commopt.tuner.moe.choose import chooser

    cuda, device, dtype, mesh = ep_setup(world)
    tokens_list, routings = cases
    if rank == 0 and "commopt auto" in variants:  # the log says what auto picked, and from which estimates
        import logging

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("torch_commopt.tuner.moe").setLevel(logging.INFO)
    out = []
    for name, model in models.items():
        for tokens in tokens_list:
            for routing in routings:
                sync_free.reset()  # sync_free's capacity: fixed anew by each case's first call
                layers = {}
                for variant in variants:
                    layer = _layer(model, device, dtype, 11, compile_children)
                    parallelize_module(layer.experts, mesh, ExpertParallel())
                    if variant.startswith("commopt"):
                        schedule = variant.split()[1]
                        swap_expert_parallel(layer, schedule, chooser(60.0) if schedule == "auto" else None)
                    elif variant == "comm-free":
                        swap_expert_parallel(layer, "a2a")  # the hooks gone; then the exchange removed
                        layer.experts.forward = _free_forward(layer, world)
                    if routing == "skewed":  # the router's bias favours the first experts
                        with torch.no_grad():
                            layer.expert_bias.copy_(torch.linspace(2.0, -2.0, layer.expert_bias.numel()))
                    layers[variant] = layer
                g = torch.Generator(device=device).manual_seed(100 + rank)
                # the layer's input needs its gradient, as every MoE layer's but a model's first: its
                # backward sends the input gradients home (without it torchtitan's autograd skips them)
                x = torch.randn(1, tokens, model[0], device=device, dtype=dtype, generator=g).requires_grad_()
                dy = torch.randn(x.shape, device=device, dtype=dtype, generator=g)  # dense, as a loss's
                ref = None
                times = {v: [] for v in variants}
                errors = {}
                for variant, layer in layers.items():  # warm-up (compiles); the output and x's gradient compared
                    _transport(variant)
                    x.grad = None
                    y = layer(x)
                    y.backward(dy)
                    got = (y.detach().float(), x.grad.float())
                    if variant == "torchtitan EP":
                        ref = got
                    elif variant != "comm-free":
                        errors[variant] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
                for r in range(rounds):
                    order = variants if r % 2 == 0 else variants[::-1]
                    for variant in order:
                        layer = layers[variant]
                        _transport(variant)
                        dist.barrier()
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            layer(x).backward(dy)
                        if cuda:
                            torch.cuda.synchronize()
                        times[variant].append((time.perf_counter() - t0) / steps * 1e3)
                med = max_over_ranks([statistics.median(times[v]) for v in variants], device)  # the slowest rank
                err = max_over_ranks([errors.get(v, 0.0) for v in variants], device)
                out.append({"model": name, "shape": dict(zip(("dim", "expert_ffn", "experts", "top_k", "shared"), model)),
                            "tokens_per_rank": tokens, "routing": routing, "raw_ms": times,
                            "ms": dict(zip(variants, med)), "max_rel_error": dict(zip(variants, err))})
                if rank == 0:  # progress: a run cut short by its time limit still tells its cases
                    print(f"{name} T={tokens} {routing}: " + ", ".join(f"{v} {t:.2f}" for v, t in out[-1]["ms"].items())
                          + " ms", flush=True)
    return out, (torch.cuda.get_device_name(device) if cuda else "cpu (gloo)")


def records(cases: list) -> list:
    """Each case with its derived figures: speedup over its baseline (torchtitan's EP; for the
    fixed-capacity rows, Inductor) and the exposed exchange hidden (where a comm-free bound ran)."""
    for c in cases:
        ms = c["ms"]
        tt, free = ms.get("torchtitan EP", ms.get("inductor")), ms.get("comm-free")
        c["speedup_vs_torchtitan"] = {v: tt / t for v, t in ms.items()}
        c["hidden_share"] = {v: ((tt - t) / (tt - free) if free is not None and tt > free else None)
                             for v, t in ms.items()}
    return cases


def _columns(cases: list) -> list[str]:
    """The variants the cases ran, VARIANTS' order first, then the by_expert:C ones in the order run."""
    ran = [v for c in cases for v in c["ms"]]
    return [v for v in VARIANTS if v in ran] + list(dict.fromkeys(v for v in ran if v not in VARIANTS))


def report(cases: list, meta: dict) -> str:
    cols = _columns(cases)
    mine = [v for v in cols if v.startswith("commopt")]
    short = [v.removeprefix("commopt ") for v in mine]
    lines = [f"# MoE layer with expert parallelism ({meta['device']}, {meta['world']} ranks)", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; fwd+bwd of one layer, median of "
             f"{meta['rounds']} rounds of {meta['steps']} steps, the slowest rank; variants in alternating order; the "
             "input needs its gradient, as in a model.", "",
             *([f"Joined from {meta['joined']} runs (commits {', '.join(meta['commits'])}): "
                + "; ".join(f"`{c}`" for c in meta['commands']), ""] if meta.get("joined") else []),
             "| model | tokens/rank | routing | " + " | ".join(f"{v} ms" for v in cols)
             + "".join(f" | {v} ×" for v in short) + "".join(f" | {v} hidden" for v in short) + " | max rel. error |",
             "|---|---|---|" + "---|" * (len(cols) + 2 * len(mine) + 1)]
    for c in cases:
        ms, sp, hid = c["ms"], c["speedup_vs_torchtitan"], c["hidden_share"]
        err = max(c["max_rel_error"].values())
        lines.append(f"| {c['model']} | {c['tokens_per_rank']} | {c['routing']} | "
                     + " | ".join(fmt(ms.get(v), 2) for v in cols)
                     + "".join(f" | {fmt(sp.get(v))}" for v in mine)
                     + "".join(f" | {fmt(hid.get(v), 2)}" for v in mine)
                     + f" | {err:.1e} |")
    lines += ["", "×: speedup over torchtitan's EP (the fixed-capacity rows, `capacity ...`: over Inductor compiling the "
              "layer whole; `bench_moe --capacity`). Hidden: the share of the exposed exchange "
              "(torchtitan EP − comm-free) that the variant removes. Error: the largest relative error of "
              "the output and of the input's gradient against torchtitan's EP.", ""]
    return "\n".join(lines)


def pieces(models: dict, tokens_list: list, worlds: list, rounds: int, chunk_counts=(2, 4, 6)) -> list:
    """One GPU: the experts' SwiGLU fwd+bwd over a rank's received rows (balanced routing), ms
    each and the ratios to whole:
    - whole: three autograd grouped GEMMs over all rows, as torchtitan runs its experts;
    - by source: the same in W pieces of one source's rows (by_peer's compute: every piece has every
      local expert, so each expert's GEMMs shrink and its weight gradient is summed over pieces);
    - by_expert:C: the by_expert schedule itself over a one-rank group (its all-to-alls local
      copies), in C chunks of experts: by_expert:1 is its compute unpipelined, the others what the
      pipelining adds (no GEMM shrinks; the weight gradients run once over all rows)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from torch_commopt.kernels.moe import sync_free as sync_free_mod
    from torch_commopt.kernels.moe.by_expert import by_expert
    from torch_commopt.kernels.moe.exchange import Routing
    from torch_commopt.kernels.moe.module import PaddedLocal
    from torch_commopt.kernels.moe.schedules import a2a_exchanged

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore())
    group = dist.group.WORLD
    out = []
    for name, (dim, hidden, experts, top_k, _) in models.items():
        for world in worlds:
            nl = experts // world
            w1 = torch.randn(nl, hidden, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            w3 = torch.randn(nl, hidden, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            w2 = torch.randn(nl, dim, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)

            def swiglu(x, per, ws=(w1, w2, w3)):
                a, b, c = ws
                offs = torch.cumsum(per, 0, dtype=torch.int32)
                h = F.silu(torch._grouped_mm(x, a.transpose(-2, -1), offs=offs))
                h = h * torch._grouped_mm(x, c.transpose(-2, -1), offs=offs)
                return torch._grouped_mm(h, b.transpose(-2, -1), offs=offs)

            padded = PaddedLocal(swiglu)  # as an installed module's experts: the rows placed into padded groups
            for tokens in tokens_list:
                rows = tokens * top_k  # what a rank receives on balanced routing
                per_piece = -(-rows // (world * nl) // 8) * 8  # rows per (source, expert), 8-aligned
                x = torch.randn(per_piece * world * nl, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
                whole = torch.full((nl,), per_piece * world, device=dev, dtype=torch.int64)
                piece = torch.full((nl,), per_piece, device=dev, dtype=torch.int64)
                by_source = x.split(per_piece * nl)
                # a dense output gradient: the grouped GEMM's backward refuses .sum()'s expanded one
                grad = torch.randn(x.shape, device=dev, dtype=torch.bfloat16)
                runs = {"whole": lambda: swiglu(x, whole).backward(grad),
                        "by source": lambda: torch.cat([swiglu(c, piece) for c in by_source]).backward(grad)}
                # by_expert itself over a one-rank group (its all-to-alls local copies), the routing
                # giving each local expert the rows W ranks would send it
                routing = Routing(0, 1, send=((per_piece * world,) * nl,), recv=((per_piece * world,) * nl,))
                # the plain schedule (a2a) and sync_free, over the same one-rank group: by_expert:1's
                # fair baseline (reorders and local exchanges as theirs, the GEMMs whole)
                runs["a2a"] = lambda: a2a_exchanged(x, routing, padded, group).backward(grad)
                sync_free_mod.set_capacity(group, x.shape[0])
                runs["sync_free"] = lambda: sync_free_mod.sync_free(x, whole, (w1, w2, w3), group).backward(grad)
                for chunks in (1,) + tuple(c for c in chunk_counts if c <= nl):
                    runs[f"by_expert:{chunks}"] = functools.partial(
                        lambda c: by_expert(x, routing, (w1, w2, w3), group, c).backward(grad), chunks)
                times = {label: [] for label in runs}
                for fn in runs.values():
                    fn()
                labels = list(runs)
                for r in range(rounds):
                    for label in (labels if r % 2 == 0 else labels[::-1]):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(5):
                            runs[label]()
                        end.record()
                        end.synchronize()
                        times[label].append(start.elapsed_time(end) / 5)
                med = {label: statistics.median(v) for label, v in times.items()}
                out.append({"model": name, "world": world, "tokens_per_rank": tokens, "rows_received": rows,
                            "ms": med, "ratio": {k: v / med["whole"] for k, v in med.items() if k != "whole"},
                            # each schedule's compute against the plain one's, all exchanging locally
                            "vs_a2a": {k: v / med["a2a"] for k, v in med.items() if k in ("by_expert:1", "sync_free")},
                            # what pipelining by_expert in C chunks costs its own compute
                            "chunked": {k: v / med["by_expert:1"] for k, v in med.items()
                                        if k.startswith("by_expert:") and k != "by_expert:1"},
                            "raw_ms": times})
    dist.destroy_process_group()
    return out


def pieces_report(rows: list, meta: dict) -> str:
    chunked = list(dict.fromkeys(k for r in rows for k in r["chunked"]))  # every row's, in order
    lines = [f"# MoE: the experts' compute whole vs in a schedule's pieces ({meta['device']}, one GPU)", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; SwiGLU fwd+bwd in bf16 over a rank's "
             f"received rows on balanced routing, median of {meta['rounds']} rounds of 5 runs. Whole: torchtitan's "
             "grouped GEMMs under autograd. By source: the same in W pieces of one source's rows (by_peer). "
             "by_expert:C: that schedule's own compute (its reorders and its all-to-alls, local copies over a "
             "one-rank group, included) in C chunks of experts; by_expert:1 is it unpipelined. a2a: the plain "
             "schedule over the same group (the same reorders and local exchanges, the GEMMs whole), by_expert:1's "
             "and sync_free's baseline; sync_free: its padded blocks and device-side index plan.", "",
             "| model | W | tokens/rank | rows received | whole ms | by source / whole | a2a / whole | "
             "by_expert:1 / a2a | sync_free / a2a | " + " | ".join(f"{k} / by_expert:1" for k in chunked) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(chunked)]
    for r in rows:
        cells = [fmt(r["chunked"][k]) if k in r["chunked"] else "-" for k in chunked]
        vs = r.get("vs_a2a", {})
        lines.append(f"| {r['model']} | {r['world']} | {r['tokens_per_rank']} | {r['rows_received']} | "
                     f"{fmt(r['ms']['whole'])} | {fmt(r['ratio']['by source'])} | {fmt(r['ratio'].get('a2a'))} | "
                     f"{fmt(vs.get('by_expert:1'))} | {fmt(vs.get('sync_free'))} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def join(paths: list, out: str | None) -> None:
    """One report of several runs of one card and world (their cases in the order given; the
    first run's meta, its command noted as joined)."""
    import json

    runs = [json.loads(open(path).read()) for path in paths]
    cards = {(r["meta"]["device"], r["meta"]["world"]) for r in runs}
    if len(cards) != 1:
        raise SystemExit(f"--join: runs of different cards or worlds: {sorted(cards)}")
    # a run joined before brings its own runs' commits and commands
    commands = [c for r in runs for c in r["meta"].get("commands", [r["meta"].get("command", "?")])]
    commits = {c for r in runs for c in r["meta"].get("commits", [r["meta"]["commit"]])}
    meta = dict(runs[0]["meta"], joined=len(commands), commits=sorted(commits), commands=commands)
    cases = [c for r in runs for c in r["cases"]]
    text = report(records(cases), meta)
    print(text)
    if out:
        write_report(out, result_stem("moe", meta["device"], meta["world"], meta["date"]), {"meta": meta, "cases": cases},
                     text)


def _variant(name: str) -> str:
    """A variant by its name ("commopt a2a") or its schedule ("a2a"), as a shell passes it."""
    for v in (name, f"commopt {name}"):
        if v in VARIANTS:
            return v
    try:
        schedule, chunks = parse_moe_schedule(name.removeprefix("commopt "))
    except ValueError:
        schedule, chunks = None, None
    if schedule == "by_expert" and chunks:
        return f"commopt by_expert:{chunks}"  # a chunk count of its own (the table's by_expert column is the default's)
    raise argparse.ArgumentTypeError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")


def _capacity(args) -> None:
    from benchmarks.moe_capacity import CAPACITY_MODELS, capacity_rank
    from torch_commopt.testing.launch import run_distributed

    models = {m: CAPACITY_MODELS[m] for m in (args.models if set(args.models) <= set(CAPACITY_MODELS)
                                              else CAPACITY_MODELS)}
    per_rank = run_distributed(capacity_rank, args.world, models, args.tokens, args.rounds, args.steps,
                               backend="nccl", timeout_s=560)
    cases, device = per_rank[0]
    meta = machine_meta(device, args.world, args.commit, rounds=args.rounds, steps=args.steps)
    text = report(records(cases), meta)
    print(text)
    if args.out:
        write_report(args.out, result_stem("moe", device, args.world, variant="capacity"), {"meta": meta, "cases": cases},
                     text)


def _graph(args) -> None:
    from benchmarks.moe_graph import graph_rank, graph_report
    from torch_commopt.testing.launch import run_distributed

    models = CPU_MODELS if args.cpu else {m: MODELS[m] for m in args.models}
    tokens = [4] if args.cpu else args.tokens
    per_rank = run_distributed(graph_rank, args.world, models, tokens, 1 if args.cpu else args.rounds,
                               1 if args.cpu else args.steps, not args.cpu, backend="gloo" if args.cpu else "nccl",
                               timeout_s=560)
    cases, device = per_rank[0]
    meta = machine_meta(device, args.world, args.commit, rounds=args.rounds, steps=args.steps)
    text = graph_report(cases, meta)
    print(text)
    if args.out and not args.cpu:
        write_report(args.out, result_stem("moe", device, args.world, variant="graph"), {"meta": meta, "cases": cases},
                     text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for the report (required except with --cpu)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens a rank (default 4096 8192 16384; with --graph 8 64 512)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--routings", nargs="+", default=["balanced", "skewed"])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), type=_variant, metavar="VARIANT",
                   help="a subset of the variants, by name or by schedule (a2a, by_expert, 'by_expert nccl', auto, "
                        "...; torchtitan EP and comm-free always run: the figures need them)")
    p.add_argument("--pieces", action="store_true", help="one GPU: the grouped GEMMs whole vs in pieces")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="--pieces: the EP degrees whose rows it runs")
    p.add_argument("--cpu", action="store_true", help="gloo smoke run with a tiny layer; prints, writes nothing")
    p.add_argument("--capacity", action="store_true",
                   help="a fixed-capacity layer compiled whole: Inductor vs commopt's chunked exchanges (moe_capacity.py)")
    p.add_argument("--graph", action="store_true",
                   help="the layer's forward at decoding sizes, eager and sync_free replayed from a CUDA graph")
    p.add_argument("--commit", default="")
    p.add_argument("--join", nargs="+", metavar="JSON",
                   help="write one report of these runs' cases (runs split by model to fit a device call)")
    args = p.parse_args()
    if args.tokens is None:
        from benchmarks.moe_graph import GRAPH_TOKENS

        args.tokens = list(GRAPH_TOKENS) if args.graph else [4096, 8192, 16384]
    if args.join:
        join(args.join, args.out)
        return

    from torch_commopt.testing.launch import run_distributed

    if args.pieces:
        import torch

        models = {m: MODELS[m] for m in args.models}
        rows = pieces(models, args.tokens, args.worlds, args.rounds)
        meta = machine_meta(torch.cuda.get_device_name(0), 1, args.commit, rounds=args.rounds)
        text = pieces_report(rows, meta)
        print(text)
        if args.out:
            write_report(args.out, result_stem("moe_pieces", meta["device"], 1), {"meta": meta, "rows": rows}, text)
        return
    if args.capacity:
        _capacity(args)
        return
    if args.graph:
        _graph(args)
        return
    if args.cpu:
        models, tokens, rounds, steps, backend, compile_children = CPU_MODELS, [32], 2, 1, "gloo", False
    else:
        models, tokens, rounds, steps, backend, compile_children = (
            {m: MODELS[m] for m in args.models}, args.tokens, args.rounds, args.steps, "nccl", True)
    variants = tuple(v for v in VARIANTS if v in args.variants or v in ("torchtitan EP", "comm-free"))
    variants += tuple(dict.fromkeys(v for v in args.variants if v not in VARIANTS))  # by_expert:C, in the order given
    per_rank = run_distributed(_rank, args.world, models, (tokens, args.routings), rounds, steps, compile_children,
                               variants, backend=backend, timeout_s=560)
    cases, device = per_rank[0]
    meta = machine_meta(device, args.world, args.commit, rounds=rounds, steps=steps)
    text = report(records(cases), meta)
    print(text)
    if args.out and not args.cpu:
        write_report(args.out, result_stem("moe", device, args.world), {"meta": meta, "cases": cases}, text)


if __name__ == "__main__":
    main()
