"""Does what else runs in a timing round change how two schedules compare?  Session 43: in the
eager-with-per-call-graphs tuner sweep, autotune's rounds (five candidates, NCCL `sequential`
among them) put AG `ce_push:1` ahead of `ce_push:1:par=1` while a head-to-head of the two put
`par=1` 2-3% ahead, on two runs.  For each such shape this times the pair in several contexts,
each read round-paired (`autotune.paired_ms`), and prints par=1 / ce_push:1 with its 95% CI:

  pair          the two alone
  pair+seq      with NCCL `sequential` in every round
  autotune      the model's top-k and sequential, as Config(mode="autotune") times them
  pair again    the two alone once more (the drift between the first and the last)

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_round_context.py --out OUT [--orders]

--orders (session 49): does the order of a round's candidates change the tuner sweep's figures?
bench_costmodel's sweep rotates the candidates (in the model's order) by one per round, so each
candidate always follows the same one; its eager sweeps put RS 4096x8192x7168 `ce_push:2` 5-9%
ahead of `ce_push:1` in five of five runs, autotune's rounds 2-4%, the head-to-head of the two
~1%.  Per shape, the sweep's whole set in the model's order (rotate), reversed (rotate: each
follows another), and shuffled per round (autotune.round_order), the pair alone, and the first
again: B / A with its 95% CI, and each figure (round-paired, as the sweep reads them).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_costmodel import TOP_K, _replayed_per_call, ranked_shape  # noqa: E402
from bench_matmul_collectives import Shape, _variants  # noqa: E402
from costmodel_vs_bench import region_shape  # noqa: E402
from torch_commopt.kernels.gpu.pick import call_graphs_pay  # noqa: E402
from torch_commopt.launch import run_distributed  # noqa: E402
from torch_commopt.tuner.autotune import measure_candidates, ratio_summary, timed_candidates  # noqa: E402
from torch_commopt.tuner.calibrate import calibrate_and_store  # noqa: E402
from torch_commopt.tuner.model import rank  # noqa: E402

SHAPES = [Shape("ag", 2048, 8192, 8192), Shape("ag", 4096, 8192, 28672), Shape("ag", 16384, 8192, 8192)]
A, B = "ce_push:1", "ce_push:1:par=1"


def worker(rank_: int, world: int, cache_dir: str) -> list[dict]:
    device = torch.device("cuda", rank_)
    group_name = dist.group.WORLD.group_name
    cal = calibrate_and_store(group_name, device, cache_dir)
    out = []
    for shape in SHAPES:
        region = region_shape({"op": shape.op, "M": shape.M, "K": shape.K, "N": shape.N, "world": world,
                               "dtype": "bfloat16"})
        (a_shape, w_shapes, _), _, _, _, op, _, _ = _variants(shape, rank_, world, group_name)
        cg = call_graphs_pay(region.kind, a_shape, w_shapes, world, "bfloat16")
        preds = rank(region, cal, graphs=cg)
        if cg:
            op = _replayed_per_call(op, region.kind)
        top = timed_candidates(preds, TOP_K)
        contexts = {"pair": [A, B], "pair+seq": [A, B, "sequential"],
                    "autotune": list(dict.fromkeys(top + [A, B])), "pair again": [A, B]}
        row = {"shape": [shape.op, shape.M, shape.K, shape.N], "call_graphs": cg, "autotune_set": top}
        for name, cands in contexts.items():
            trace: list = []
            figures = measure_candidates(op, cands, group_name, device, graphs=False, trace=trace, rounds=15)
            row[name] = dict(ratio_summary(trace, B, A), figures_ms=figures)
        out.append(row)
        if rank_ == 0:
            print(f"{shape.op} {shape.M}x{shape.K}x{shape.N} cg={int(cg)}: " + "; ".join(
                f"{n} {row[n]['median']:.3f} [{row[n]['lo']:.3f}, {row[n]['hi']:.3f}]" for n in contexts), flush=True)
        torch.cuda.empty_cache()
    return out


# --orders: (shape, A = the eager sweeps' usual model top-1, B = their measured best)
ORDER_SHAPES = [(Shape("rs", 4096, 8192, 7168), "ce_push:1", "ce_push:2"),
                (Shape("ar", 2048, 8192, 8192), "ce_push:1", "ce_push:2"),
                (Shape("ag", 2048, 8192, 8192), "ce_push:1:par=1", "ce_push:1"),
                (Shape("ag", 16384, 8192, 8192), "ce_push:1:par=1", "ce_push:1")]


def order_worker(rank_: int, world: int, cache_dir: str) -> list[dict]:
    """The sweep's set of each ORDER_SHAPES shape timed in several round orders (--orders)."""
    device = torch.device("cuda", rank_)
    group_name = dist.group.WORLD.group_name
    cal = calibrate_and_store(group_name, device, cache_dir)
    out = []
    for shape, a, b in ORDER_SHAPES:
        _, preds, op, cg = ranked_shape(shape, rank_, world, group_name, cal, device, cache_dir, False, True)
        names = [str(p.schedule) for p in preds]  # the sweep's order
        contexts = {"sweep rotate": (names, "rotate"), "sweep reversed": (names[::-1], "rotate"),
                    "sweep shuffle": (names, "shuffle"), "pair": ([a, b], "rotate"),
                    "sweep rotate again": (names, "rotate")}
        row = {"shape": [shape.op, shape.M, shape.K, shape.N], "call_graphs": cg, "order": names, "a": a, "b": b}
        for name, (cands, order) in contexts.items():
            trace: list = []
            figures = measure_candidates(op, cands, group_name, device, graphs=False, trace=trace, rounds=15,
                                         order=order)
            best = min(figures, key=figures.get)
            row[name] = dict(ratio_summary(trace, b, a), figures_ms=figures, best=best,
                             top1_gap=figures[names[0]] / figures[best] - 1, trace=trace)
        out.append(row)
        if rank_ == 0:
            print(f"{shape.op} {shape.M}x{shape.K}x{shape.N} cg={int(cg)} {b} / {a}: " + "; ".join(
                f"{n} {row[n]['median']:.3f} [{row[n]['lo']:.3f}, {row[n]['hi']:.3f}] top-1 gap {row[n]['top1_gap']:+.1%}"
                for n in contexts), flush=True)
        torch.cuda.empty_cache()
    return out


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--orders", action="store_true", help="the round-order mode (see the docstring)")
    args = parser.parse_args()
    rows = run_distributed(order_worker if args.orders else worker, args.world,
                           tempfile.mkdtemp(prefix="commopt_probe_"), backend="nccl", timeout_s=600)[0]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(0), "world": args.world, "torch": torch.__version__,
           "ratio": "b / a" if args.orders else f"{B} / {A}", "per": "round, median [95% CI]", "rows": rows}
    name = "probe_round_order.json" if args.orders else "probe_round_context.json"
    (out / name).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
