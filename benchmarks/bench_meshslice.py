"""MeshSlice's comparison in the cluster simulator (tuner/mesh2d/simulate.py; issue 71).

--simulate: the FC layers of one GPT-3 175B and one Megatron-NLG 530B block (batch = chips
sequences of 2048), forward and both backward GEMMs, under MeshSlice (each layer's best slice
count), the Collective 2D GEMM, SUMMA and Wang's one-axis collective matmul, each at its fastest
mesh shape:
- on 256 TPUv4-like chips with the authors' simulation figures, and with their measured v4-32
  figures; the paper's tuner (analytic) and the exact one (every shape and S priced) side by side;
- on H200 clusters of 8-GPU NVLink nodes at 64, 128 and 256 GPUs, next to 1D tensor parallelism
  inside a node with data parallelism across nodes, and each one's FC weight state a GPU holds.

    python3 -m benchmarks.bench_meshslice --simulate --out benchmarks/results [--commit SHA]

--measure (issue 73, 4 GPUs as a 2 x 2 mesh; --cpu: a gloo smoke run with small layers): the same
block's FC layers at tokens x dim (default 8192 x 4096, bf16) trained forward and backward through
the reference kernels (kernels/mesh2d/reference.py: c10d collectives, each slice's in flight while
the one before multiplies) as Collective (S = 1), MeshSlice (each layer's S from the exact tuner
on the simulator's figures for one NVLink node) and SUMMA, each layer's ms the median of rounds on
the slowest rank, beside the simulator's prediction for that machine.

    python3 -m benchmarks.bench_meshslice --measure --out DIR [--world 4] [--tokens 8192 --dim 4096]
    python3 -m benchmarks.bench_meshslice --measure --cpu    # gloo smoke run: prints, writes nothing
"""

from __future__ import annotations

import argparse
import dataclasses

from benchmarks.common import machine_meta, result_stem, write_report


def _tpu_rows(sim, tune, model) -> tuple[list[dict], list[str]]:
    rows, lines = [], []
    for machine, links in (("simulation figures", sim.TPU_V4_SIM), ("measured v4-32 figures", model.TPU_V4)):
        for name, (heads, dim) in sim.MODELS.items():
            layers = tune.transformer_block(256 * sim.SEQ, heads * dim)
            res = sim.compare(layers, 256, links)
            analytic, exact = tune.analytic_plan(layers, 256, links), tune.exact_plan(layers, 256, links)
            ms = res["meshslice"].seconds
            rest = sim.rest_of_block_s(heads, dim, links.flops_per_s, sim.TPU_V4_HBM_BYTES_PER_S)
            block = {a: r.seconds + rest for a, r in res.items()}  # the whole block: end to end
            rows.append({"machine": machine, "model": name, "results": {a: dataclasses.asdict(r) for a, r in res.items()},
                         "rest_of_block_s": rest, "block_s": block,
                         "analytic": dataclasses.asdict(analytic), "exact": dataclasses.asdict(exact)})
            lines.append(f"| {machine} | {name} | " + " | ".join(
                f"{r.seconds * 1e3:.1f} ({r.mesh[0]}x{r.mesh[1]}, {r.utilisation:.2f})" for r in res.values())
                + f" | {res['wang'].seconds / ms:.3f} | {res['collective'].seconds / ms:.3f} | {rest * 1e3:.1f} | "
                f"{block['wang'] / block['meshslice']:.3f} | {block['collective'] / block['meshslice']:.3f} | "
                f"{analytic.mesh[0]}x{analytic.mesh[1]} S={','.join(map(str, analytic.slices.values()))} | "
                f"{exact.mesh[0]}x{exact.mesh[1]} S={','.join(map(str, exact.slices.values()))} |")
    return rows, lines


def _gpu_rows(sim, tune) -> tuple[list[dict], list[str]]:
    cluster, rows, lines = sim.GPUCluster(), [], []
    for chips in (64, 128, 256):
        shapes = [(chips // c, c) for c in (2, 4, 8, 16, 32) if chips // c >= 2]
        for name, (heads, dim) in sim.MODELS.items():
            layers = tune.transformer_block(chips * sim.SEQ, heads * dim)
            res = sim.compare(layers, chips, cluster.links, shapes)
            tp_dp = sim.tp_dp_seconds(layers, chips, cluster)
            tp_fsdp = sim.tp_fsdp_seconds(layers, chips, cluster)
            rest = sim.rest_of_block_s(heads, dim, cluster.flops_per_s, sim.H200_HBM_BYTES_PER_S)
            mem_2d = sim.weight_bytes_per_chip(layers, chips, chips) / 2**30
            mem_1d = sim.weight_bytes_per_chip(layers, chips, cluster.gpus_per_node) / 2**30
            rows.append({"gpus": chips, "model": name, "results": {a: dataclasses.asdict(r) for a, r in res.items()},
                         "tp_dp_s": tp_dp, "tp_fsdp_s": tp_fsdp, "rest_of_block_s": rest, "fc_state_gib_2d": mem_2d,
                         "fc_state_gib_tp8": mem_1d})
            ms = res["meshslice"].seconds
            lines.append(f"| {chips} | {name} | " + " | ".join(
                f"{r.seconds * 1e3:.1f} ({r.mesh[0]}x{r.mesh[1]}, {r.utilisation:.2f})" for r in res.values())
                + f" | {tp_dp * 1e3:.1f} | {tp_dp / ms:.2f} | {tp_fsdp * 1e3:.1f} | {tp_fsdp / ms:.2f} | {rest * 1e3:.2f} | "
                f"{(tp_dp + rest) / (ms + rest):.2f} | {(tp_fsdp + rest) / (ms + rest):.2f} | {mem_2d:.2f} / {mem_1d:.2f} |")
    return rows, lines


def _batch_rows(sim, tune) -> tuple[list[dict], list[str]]:
    """The H200 clusters at fewer tokens a GPU (a node's GEMMs shorter against its weight
    gathers): MeshSlice at its best shape, 1D TP=8 + DP, 1D TP=8 + FSDP."""
    cluster, rows, lines = sim.GPUCluster(), [], []
    for per_gpu in (2048, 1024, 512, 256):
        for chips in (64, 256):
            shapes = [(chips // c, c) for c in (2, 4, 8, 16, 32) if chips // c >= 2]
            for name, (heads, dim) in sim.MODELS.items():
                layers = tune.transformer_block(chips * per_gpu, heads * dim)
                ms = sim.compare(layers, chips, cluster.links, shapes)["meshslice"]
                tp_dp, tp_fsdp = sim.tp_dp_seconds(layers, chips, cluster), sim.tp_fsdp_seconds(layers, chips, cluster)
                rows.append({"tokens_a_gpu": per_gpu, "gpus": chips, "model": name, "meshslice_s": ms.seconds,
                             "mesh": ms.mesh, "tp_dp_s": tp_dp, "tp_fsdp_s": tp_fsdp})
                lines.append(f"| {per_gpu} | {chips} | {name} | {ms.seconds * 1e3:.1f} ({ms.mesh[0]}x{ms.mesh[1]}) | "
                             f"{tp_dp * 1e3:.1f} | {tp_fsdp * 1e3:.1f} | {tp_fsdp / ms.seconds:.2f} |")
    return rows, lines


ALGS = {"collective": 1, "summa": 0}  # fc_2d's slices for the baselines; MeshSlice's come from the tuner


def _measure_rank(rank: int, world: int, tokens: int, dim: int, rounds: int, cpu: bool) -> dict:
    """{layer: {algorithm: slowest rank's median ms of forward + backward}} on a sqrt(W) mesh."""
    import math
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torch_commopt.kernels.mesh2d.reference import fc_2d, stored_shapes
    from torch_commopt.tuner.mesh2d import simulate as sim
    from torch_commopt.tuner.mesh2d import tune
    from torch_commopt.tuner.mesh2d.model import layer_s

    side = math.isqrt(world)
    shape = (side, world // side)
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, shape)
    rows, cols = mesh.get_group(0), mesh.get_group(1)
    dtype = torch.float32 if cpu else torch.bfloat16
    links = sim.GPUCluster().links(shape)
    out = {}
    for layer in tune.transformer_block(tokens, dim):
        plan = tune.exact_plan([layer], world, links, shapes=[shape])
        algs = {**ALGS, "meshslice": plan.slices[layer.name]}
        gen = torch.Generator(device=device).manual_seed(rank)
        x, w, dy = (torch.randn(a // shape[0], b // shape[1], generator=gen, device=device, dtype=dtype)
                    for a, b in stored_shapes(layer.dataflow, layer.transposed, tokens, layer.in_features,
                                              layer.out_features))
        w = (w / layer.in_features ** 0.5).requires_grad_()
        times = {a: [] for a in algs}

        def step(slices):
            xg = x.detach().requires_grad_()
            fc_2d(xg, w, layer.dataflow, rows, cols, slices, transposed=layer.transposed).backward(dy)
        for s in algs.values():  # warm-up
            step(s)
        for r in range(rounds):
            for a, s in (list(algs.items()) if r % 2 == 0 else list(algs.items())[::-1]):
                dist.barrier()
                if not cpu:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                step(s)
                if not cpu:
                    torch.cuda.synchronize(device)
                times[a].append((time.perf_counter() - t0) * 1e3)
        med = torch.tensor([statistics.median(times[a]) for a in algs], dtype=torch.float64,
                           device=device if not cpu else "cpu")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        predicted = {a: layer_s(layer, shape, links, "meshslice" if a == "meshslice" else a,
                                    algs["meshslice"]) * 1e3 for a in algs}
        out[layer.name] = {"dataflow": layer.dataflow, "slices": algs["meshslice"],
                           "measured_ms": dict(zip(algs, med.tolist())), "predicted_ms": predicted}
    return out


def measure(args) -> None:
    import torch

    from torch_commopt.testing.launch import run_distributed

    tokens, dim = (64 * args.world, 32 * args.world) if args.cpu else (args.tokens, args.dim)
    per_rank = run_distributed(_measure_rank, args.world, tokens, dim, args.rounds, args.cpu,
                               backend="gloo" if args.cpu else "nccl", timeout_s=560)
    layers = per_rank[0]
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    lines = [f"# MeshSlice on a real mesh: {args.world} ranks ({device})", "",
             f"`{' '.join(['python3', '-m', 'benchmarks.bench_meshslice', '--measure'])}`, tokens {tokens}, dim {dim}; "
             "forward + backward of each FC layer through the reference kernels, median of "
             f"{args.rounds} rounds, slowest rank; predicted: the simulator's one-node figures.", "",
             "| layer | dataflow | S | collective ms | meshslice ms | summa ms | meshslice vs collective | "
             "predicted (coll. / mesh. / summa) | predicted / measured (meshslice) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in layers.items():
        m, p = r["measured_ms"], r["predicted_ms"]
        lines.append(f"| {name} | {r['dataflow']} | {r['slices']} | {m['collective']:.3f} | {m['meshslice']:.3f} | "
                     f"{m['summa']:.3f} | {m['collective'] / m['meshslice']:.2f} | {p['collective']:.3f} / "
                     f"{p['meshslice']:.3f} / {p['summa']:.3f} | {p['meshslice'] / m['meshslice']:.2f} |")
    print("\n".join(lines))
    if args.cpu:
        return
    meta = machine_meta(device, args.world, args.commit, tokens=tokens, dim=dim, rounds=args.rounds)
    paths = write_report(args.out, result_stem("meshslice", device, args.world), {"meta": meta, "layers": layers},
                         "\n".join(lines) + "\n")
    print("wrote", *paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulate", action="store_true", help="the simulator's comparison")
    parser.add_argument("--measure", action="store_true", help="a real 2 x 2 mesh (4 GPUs, or --cpu)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default="")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", action="store_true", help="--measure as a gloo smoke run with small layers")
    args = parser.parse_args()
    if args.simulate == args.measure:
        parser.error("give one of --simulate and --measure")
    if args.out is None and not args.cpu:
        parser.error("--out is required")
    if args.measure:
        measure(args)
        return

    from torch_commopt.tuner.mesh2d import model, tune
    from torch_commopt.tuner.mesh2d import simulate as sim

    tpu, tpu_lines = _tpu_rows(sim, tune, model)
    gpu, gpu_lines = _gpu_rows(sim, tune)
    batch, batch_lines = _batch_rows(sim, tune)
    meta = machine_meta("cpu", 1, args.commit, simulated=True)
    algs = " | ".join(f"{a} ms (mesh, util.)" for a in model.ALGORITHMS)
    lines = [
        "# MeshSlice in the cluster simulator (one transformer block: its FC layers, then the whole block)", "",
        f"commit {meta['commit']}, {meta['date']}; `{meta['command']}`. The cost model of "
        "`torch_commopt/tuner/mesh2d` (no GPU): the forward and both backward GEMMs of the block's four FC "
        "layers (batch = chips sequences of 2048 tokens, bf16), each algorithm at its fastest mesh shape; "
        "utilisation = the layers' FLOPs / (chips x peak x seconds).", "",
        "## 256 TPUv4-like chips", "",
        f"| figures | model | {algs} | MeshSlice vs Wang | vs Collective | rest of the block ms | block: MeshSlice "
        "vs Wang | block: vs Collective | paper's tuner | exact tuner |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *tpu_lines, "",
        "The paper reports MeshSlice 12.0% (GPT-3) and 23.4% (Megatron-NLG) faster end to end than Wang at 256 "
        "chips, and 27.8% / 19.1% faster than Collective / Wang on average over the 16 FC GEMMs (from the issue; "
        "the paper's text is not in the library). The algorithms' columns are the FC layers; the rest of the block "
        "(attention's core over causal scores at the GEMM rate, the layer norms, residual adds and the FFN's "
        "activation at HBM speed, forward and backward: `simulate.rest_of_block_s`) is local and the same for every "
        "algorithm, and the block columns divide the whole block's times: the end-to-end figure, a training step "
        "being its blocks. The authors' code has no Wang model; Wang's ring steps here are priced as it prices a "
        "ring of sendrecvs (`CostModel.LogicalRing_ISplit`: per step max(GEMM, bytes / (2 bw) + latency + overhead), "
        "its sendrecv figures), the row axis's collective exposed, each algorithm at its fastest mesh shape.", "",
        "## H200 clusters (8-GPU NVLink nodes, one 400 Gb/s NIC a GPU)", "",
        f"| GPUs | model | {algs} | 1D TP=8 + DP ms | 1D / MeshSlice | 1D TP=8 + FSDP ms | 1D+FSDP / MeshSlice "
        "| rest of the block ms | block: 1D / MeshSlice | block: 1D+FSDP / MeshSlice | FC state a GPU, GiB (2D, 1D+FSDP "
        "/ TP=8) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", *gpu_lines, "",
        "1D TP + DP: TP over a node's 8 GPUs (async-TP: each GEMM against its NVLink all-gather or "
        "reduce-scatter), DP over the nodes (the weight-gradient all-reduce hidden behind the layer's backward "
        "where shorter). 1D TP + FSDP: the same TP, FSDP (ZeRO-3) over the nodes, so a GPU holds what 2D TP leaves it: "
        "each layer's TP-shard weight all-gathered over the NICs before its forward and its backward, its gradient "
        "reduce-scattered, each gather prefetched behind the layer before's GEMMs (`simulate.tp_fsdp_seconds`). FC "
        "state: bf16 weights and gradients, fp32 Adam moments and master weights, for this one block; a model holds "
        "its layer count of them (96 for GPT-3, 105 for Megatron-NLG).", "",
        "### Fewer tokens a GPU", "",
        "The FC layers' ms at fewer tokens a GPU (the global batch in 2048-token sequences scaled down): a node's "
        "GEMMs shrink with its tokens while FSDP's weight gathers do not, and so does 2D TP's traffic where a "
        "layer keeps its output or input in place (the dataflow rule) and moves weight blocks.", "",
        "| tokens a GPU | GPUs | model | meshslice ms (mesh) | 1D TP=8 + DP ms | 1D TP=8 + FSDP ms | 1D+FSDP / MeshSlice |",
        "|---|---|---|---|---|---|---|", *batch_lines, ""]
    stem = result_stem("meshslice_sim", "cpu", 1)
    paths = write_report(args.out, stem, {"meta": meta, "tpu": tpu, "gpu": gpu, "gpu_batch": batch}, "\n".join(lines))
    print("\n".join(lines))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
