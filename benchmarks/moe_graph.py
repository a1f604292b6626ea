"""bench_moe --graph: one MoE layer's forward at decoding sizes, eagerly and replayed from a CUDA graph.

torchtitan 0.2.2's MoE layer (router, top-k, grouped experts, shared experts; its children but
the experts compiled by Inductor, as torchtitan compiles them) in inference (no gradient), bf16,
a few tokens a rank, balanced routing.  Variants, in alternating order each round:
- `torchtitan EP`, `commopt a2a`, `commopt sync_free`: each layer's forward called eagerly, `steps`
  calls back to back;
- `commopt sync_free graphed`: the same layer as `commopt sync_free`, its whole forward captured
  once in a CUDA graph over a static input and replayed `steps` times.  The other schedules read
  the counts on the host (a synchronizing copy), which a capture cannot hold.
Per variant: ms per forward (the median over rounds, slowest rank), speedup over torchtitan's EP,
the host synchronizations one eager forward makes (torch.cuda.set_sync_debug_mode("warn"),
counted), and the largest relative error of the output against torchtitan's EP.  A capture that
fails is reported with its error, not timed.  On a CPU (gloo smoke run) the eager variants alone.
"""

from __future__ import annotations

import statistics
import time
import warnings

from benchmarks.common import fmt, max_over_ranks

GRAPH_TOKENS = (8, 64, 512)
EAGER = ("torchtitan EP", "commopt a2a", "commopt sync_free")
GRAPHED = "commopt sync_free graphed"


def _layers(model: tuple, mesh, device, dtype, compile_children: bool) -> dict:
    """{variant: layer} for the eager variants (the graphed one replays the sync_free layer)."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from benchmarks.bench_moe import _layer
    from torch_commopt.kernels.moe.module import swap_expert_parallel

    layers = {}
    for variant in EAGER:
        layer = _layer(model, device, dtype, 11, compile_children)
        parallelize_module(layer.experts, mesh, ExpertParallel())
        if variant.startswith("commopt"):
            swap_expert_parallel(layer, variant.split()[1])
        layers[variant] = layer
    return layers


def _syncs(layer, x) -> int:
    """The host synchronizations one forward makes (CUDA's sync debug mode's warnings, counted)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _captured(layer, x):
    """(graph, its output) of `layer`'s forward over the static input x, captured after two calls
    on a side stream; (None, the error's text) where the capture fails."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                layer(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        return graph, out
    except RuntimeError as e:
        return None, str(e).splitlines()[0]


def _timed(run, steps: int, cuda: bool) -> float:
    """ms per call of `steps` calls back to back, between two barriers and synchronizations."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _case(layers: dict, x, rounds: int, steps: int, cuda: bool) -> dict:
    """One case's raw figures: times per round, errors against torchtitan's EP, syncs, and the
    graphed variant's (or its capture's error)."""
    ref = layers["torchtitan EP"](x)
    runs = {v: (lambda layer=layer: layer(x)) for v, layer in layers.items()}
    errors = {v: _rel(layer(x), ref) for v, layer in layers.items()}
    syncs = {v: _syncs(layer, x) for v, layer in layers.items()} if cuda else {}
    failed = None
    if cuda:
        graph, out = _captured(layers["commopt sync_free"], x)
        if graph is None:
            failed = out
        else:
            graph.replay()
            errors[GRAPHED] = _rel(out, ref)
            runs[GRAPHED] = graph.replay
    times = {v: [] for v in runs}
    for r in range(rounds):
        for v in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            times[v].append(_timed(runs[v], steps, cuda))
    return {"raw_ms": times, "errors": errors, "syncs": syncs, "capture_failed": failed}


def graph_rank(rank: int, world: int, models: dict, tokens_list: list, rounds: int, steps: int,
               compile_children: bool):
    """This rank's cases (bench_moe --graph); (cases, device name)."""
    import torch

    from benchmarks.bench_moe import ep_setup
    from torch_commopt.kernels.moe import sync_free

    cuda, device, dtype, mesh = ep_setup(world)
    out = []
    for name, model in models.items():
        for tokens in tokens_list:
            sync_free.reset()  # the capacity: fixed anew by the case's first call
            layers = _layers(model, mesh, device, dtype, compile_children)
            g = torch.Generator(device=device).manual_seed(100 + rank)
            x = torch.randn(1, tokens, model[0], device=device, dtype=dtype, generator=g)
            with torch.no_grad():
                case = _case(layers, x, rounds, steps, cuda)
            variants = list(case["raw_ms"])
            med = max_over_ranks([statistics.median(case["raw_ms"][v]) for v in variants], device)
            err = max_over_ranks([case["errors"].get(v, 0.0) for v in variants], device)
            out.append({"model": name, "tokens_per_rank": tokens, "ms": dict(zip(variants, med)),
                        "max_rel_error": dict(zip(variants, err)), **case})
            if rank == 0:
                print(f"{name} T={tokens}: " + ", ".join(f"{v} {t:.3f}" for v, t in out[-1]["ms"].items()) + " ms",
                      flush=True)
    return out, (torch.cuda.get_device_name(device) if cuda else "cpu (gloo)")


def graph_report(cases: list, meta: dict) -> str:
    cols = [v for v in (*EAGER, GRAPHED) if any(v in c["ms"] for c in cases)]
    lines = [f"# A MoE layer's forward at decoding sizes, eager and replayed ({meta['device']}, {meta['world']} ranks)",
             "", f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; inference (no gradient), bf16, "
             f"balanced routing; ms per forward: the median of {meta['rounds']} rounds of {meta['steps']} calls back "
             "to back, the slowest rank; variants in alternating order.", "",
             "| model | tokens/rank | " + " | ".join(f"{v} ms" for v in cols) + " | "
             + " | ".join(f"{v.removeprefix('commopt ')} ×" for v in cols[1:])
             + " | host syncs a forward (tt / a2a / sync_free) | max rel. error | capture |",
             "|---|---|" + "---|" * (2 * len(cols) + 2)]
    for c in cases:
        ms, tt = c["ms"], c["ms"]["torchtitan EP"]
        syncs = " / ".join(str(c["syncs"].get(v, "-")) for v in EAGER)
        lines.append(f"| {c['model']} | {c['tokens_per_rank']} | " + " | ".join(fmt(ms.get(v)) for v in cols) + " | "
                     + " | ".join(fmt(tt / ms[v] if v in ms else None, 2) for v in cols[1:])
                     + f" | {syncs} | {max(c['max_rel_error'].values()):.1e} | "
                     + (f"failed: {c['capture_failed']}" if c.get("capture_failed") else "ok") + " |")
    lines += ["", "×: speedup over torchtitan's EP called eagerly. Host syncs: the synchronizing CUDA calls of one "
              "eager forward (torch.cuda.set_sync_debug_mode('warn')). Error: against torchtitan's EP's output.", ""]
    return "\n".join(lines)
