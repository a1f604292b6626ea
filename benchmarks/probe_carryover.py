"""Does a schedule's timing carry what ran before it?  Session 43's eager tuner sweeps put AG
`ce_push:1:par=1` 3% ahead of `ce_push:1` in every head-to-head of the two (M_global 2048 with
per-call graphs, on two machines) while autotune's rounds, which time five or six candidates,
found them level or par=1 behind; probe_round_context.py then saw the pair's ratio move ~2%
between two measurements of the pair alone.  This tells a context apart from drift: it times
the pair alone between every other measurement, and in between the pair with one more
candidate, or autotune's whole set, so a context that changes the ratio shows against the pair
measurements on both sides of it.

Each measurement is `autotune.measure_candidates` (15 rounds, read round-paired) and keeps its
samples; per measurement: every ratio of the first candidates (A, B, and C where given) per
round, median and 95% CI, the host's enqueue ms per call (median over rounds; a call whose
host time reaches its GPU time is host-bound, and a host slowed by the context would hand the
win to the schedule with less host work), and the per-call graphs captured / replayed / run
eagerly meanwhile (a capture inside a timed sample costs it milliseconds).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_carryover.py --out OUT [--first-capture]

--first-capture: session 44's first run found the first pair measurement at M_global 2048 (per-call
graphs) 0.87, every later one 0.97-0.99: ce_push:1, whose per-call graphs were the process's first,
ran ~10% slower in all its rounds.  This mode asks whether the first graphs captured on a stream
replay slower: fresh processes, each timing the pair a few times, in either order, after another
schedule's graphs were captured first, and again after the graphs are dropped and captured anew.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_costmodel import _replayed_per_call  # noqa: E402
from bench_matmul_collectives import Shape, _variants  # noqa: E402
from torch_commopt.kernels.gpu import call_graphs  # noqa: E402
from torch_commopt.launch import run_distributed  # noqa: E402
from torch_commopt.tuner.autotune import measure_candidates, ratio_summary  # noqa: E402

A, B = "ce_push:1", "ce_push:1:par=1"
# (shape, per-call graphs, autotune's set as session 43's eager sweeps timed it)
CASES = [
    (Shape("ag", 2048, 8192, 8192), True,
     [B, A, "ce_push:2", "ce_push:1:gemm=whole", "sequential", "ce_push:4"]),
    (Shape("ag", 4096, 8192, 28672), False, [B, A, "ce_push:4", "ce_push:2", "sequential"]),
    (Shape("ag", 16384, 8192, 8192), False, [B, A, "ce_push:4", "ce_push:2", "sequential"]),
]
ROUNDS = 15


def sequence(full: list[str]) -> list[tuple[str, list[str]]]:
    """The measurements in order: the pair between every other one."""
    others = [s for s in full if s not in (A, B)]
    seq: list[tuple[str, list[str]]] = [("pair", [A, B]), ("set", full)]
    for s in others:
        seq += [("pair", [A, B]), (f"pair+{s}", [A, B, s])]
    seq += [("pair", [A, B]), ("set", full), ("pair", [A, B])]
    return seq


def worker(rank_: int, world: int) -> list[dict]:
    device = torch.device("cuda", rank_)
    group_name = dist.group.WORLD.group_name
    out = []
    for shape, cg, full in CASES:
        (_, _, _), _, _, _, op, _, _ = _variants(shape, rank_, world, group_name)
        if cg:
            op = _replayed_per_call(op, "ag_matmul")
        stats = call_graphs.for_stream(device).stats
        rows = []
        for name, cands in sequence(full):
            trace: list = []
            host: dict = {}
            before = dict(stats)
            figures = measure_candidates(op, cands, group_name, device, trace=trace, host=host, rounds=ROUNDS)
            rows.append({"context": name, "candidates": cands, "figures_ms": figures, "host_ms": host,
                         "cg": {k: stats[k] - before[k] for k in stats},
                         "par1_over_ce1": ratio_summary(trace, B, A),
                         "trace": [[r, s, round(ms, 5)] for r, s, ms in trace]})
            if rank_ == 0:
                r = rows[-1]["par1_over_ce1"]
                print(f"{shape.op} {shape.M}x{shape.K}x{shape.N} cg={int(cg)} {name}: {B}/{A} "
                      f"{r['median']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]; host ms {host.get(A, 0):.3f} / "
                      f"{host.get(B, 0):.3f} vs {figures[A]:.3f} / {figures[B]:.3f}; cg {rows[-1]['cg']}", flush=True)
        out.append({"shape": [shape.op, shape.M, shape.K, shape.N], "call_graphs": cg, "set": full,
                    "measurements": rows})
        torch.cuda.empty_cache()
    return out


FIRST_CASES = {  # name: (pair order, schedule whose graphs are captured before the pair's, drop graphs midway)
    "ce1_first": ([A, B], None, True),
    "par1_first": ([B, A], None, True),
    "after_ce_push4": ([A, B], "ce_push:4", False),
}


def _first_shape(rank_: int, world: int):
    """(device, group name, op by schedule with per-call graphs, this stream's CallGraphs) of
    CASES[0], AG M_global 2048."""
    device = torch.device("cuda", rank_)
    group_name = dist.group.WORLD.group_name
    (_, _, _), _, _, _, op, _, _ = _variants(CASES[0][0], rank_, world, group_name)
    return device, group_name, _replayed_per_call(op, "ag_matmul"), call_graphs.for_stream(device)


def worker_first(rank_: int, world: int, case: str) -> list[dict]:
    order, prelude, drop = FIRST_CASES[case]
    device, group_name, op, graphs = _first_shape(rank_, world)
    if prelude:
        for _ in range(6):  # both halves' sightings and captures, then replays
            op(prelude)
        torch.cuda.synchronize(device)
    rows = []
    for i in range(5):
        if drop and i == 3:
            graphs.clear()
        trace: list = []
        before = dict(graphs.stats)
        figures = measure_candidates(op, order, group_name, device, trace=trace, rounds=ROUNDS)
        medians = {c: statistics.median(ms for r, s, ms in trace if s == c and r > 0) for c in order}
        rows.append({"measurement": i, "dropped_before": drop and i == 3, "figures_ms": figures,
                     "medians_ms_after_round0": medians, "cg": {k: graphs.stats[k] - before[k] for k in graphs.stats},
                     "par1_over_ce1": ratio_summary(trace, B, A), "trace": [[r, s, round(ms, 5)] for r, s, ms in trace]})
        if rank_ == 0:
            r = rows[-1]["par1_over_ce1"]
            print(f"first-capture {case} #{i}{' (graphs dropped)' if drop and i == 3 else ''}: {B}/{A} "
                  f"{r['median']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]; medians {A} {medians[A]:.4f} {B} {medians[B]:.4f}; "
                  f"cg {rows[-1]['cg']}", flush=True)
    return rows


DECAY_CASES = ("pre_ce1", "pre_ce1_sleep", "dummy_graph")


def worker_decay(rank_: int, world: int, case: str) -> list[dict]:
    """How long the first graphs' slowness lasts, and what absorbs it: pre_ce1 captures ce_push:1's
    graphs first, then times the pair in short measurements; pre_ce1_sleep waits 2 s after those
    captures; dummy_graph captures and replays an unrelated small graph (torch.cuda.graph) first."""
    import time

    device, group_name, op, graphs = _first_shape(rank_, world)
    if case == "dummy_graph":
        x = torch.randn(256, 256, device=device)
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            torch.mm(x, x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                keep = [torch.mm(x, x)]  # the graph's output, alive while it replays
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize(device)
        keep.clear()
    else:
        for _ in range(6):
            op(A)
        torch.cuda.synchronize(device)
        if case == "pre_ce1_sleep":
            time.sleep(2.0)
    t0 = time.perf_counter()
    rows = []
    for i in range(8 if case == "pre_ce1" else 3):
        trace: list = []
        before = dict(graphs.stats)
        measure_candidates(op, [A, B], group_name, device, trace=trace, rounds=5 if case == "pre_ce1" else ROUNDS)
        medians = {c: statistics.median(ms for r, s, ms in trace if s == c) for c in (A, B)}
        rows.append({"measurement": i, "since_s": time.perf_counter() - t0, "medians_ms": medians,
                     "cg": {k: graphs.stats[k] - before[k] for k in graphs.stats},
                     "par1_over_ce1": ratio_summary(trace, B, A), "trace": [[r, s, round(ms, 5)] for r, s, ms in trace]})
        if rank_ == 0:
            r = rows[-1]["par1_over_ce1"]
            print(f"decay {case} #{i} at {rows[-1]['since_s']:.2f} s: {B}/{A} {r['median']:.3f}; medians {A} "
                  f"{medians[A]:.4f} {B} {medians[B]:.4f}; cg {rows[-1]['cg']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--first-capture", action="store_true")
    parser.add_argument("--decay", action="store_true")
    args = parser.parse_args()
    doc = {"device": torch.cuda.get_device_name(0), "world": args.world, "torch": torch.__version__}
    if args.decay:
        name = "probe_carryover_decay.json"
        doc["cases"] = {case: run_distributed(worker_decay, args.world, case, backend="nccl", timeout_s=300)[0]
                        for case in DECAY_CASES}
    elif args.first_capture:
        name = "probe_carryover_first_capture.json"
        doc.update(shape=list(CASES[0][0].__dict__.values()), ratio=f"{B} / {A}", rounds=ROUNDS,
                   cases={case: run_distributed(worker_first, args.world, case, backend="nccl", timeout_s=300)[0]
                          for case in FIRST_CASES})
    else:
        name = "probe_carryover.json"
        doc.update(ratio=f"{B} / {A}, per round, median [95% CI]", rounds=ROUNDS,
                   cases=run_distributed(worker, args.world, backend="nccl", timeout_s=600)[0])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
