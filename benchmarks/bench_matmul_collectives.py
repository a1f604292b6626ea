"""AG+GEMM, GEMM+RS and GEMM+AR on W GPUs: every commopt schedule next to the baselines.

One run times, per shape (global M, K, N; bf16, or float8 with --dtype): the GEMM alone, the collective alone (NCCL),
NCCL sequential (`dist` collective + `torch.mm` called directly, as a user would), PyTorch
async-TP (`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`,
symmetric memory enabled for the group), every commopt schedule (`sequential` included: the
same NCCL + cuBLAS work through the op), and commopt's pick (the built-in rule's schedule,
timed on its own), and the overlap floor: the same GEMM with the collective's bytes pushed to
the peers by the copy engine beside it, with no dependency between the two: what moving those
bytes over NVLink costs a GEMM running beside them (memory traffic, power), with no protocol
and no split GEMM; `hidden_fraction_ceiling` is the hidden fraction that floor itself reaches
(2x H200: 0.96-1.08 on the balanced shapes).  Times: CUDA events around back-to-back calls (at least `iters`, and at
least 10 ms of them), median of `repeats` rounds (variants round-robin within a round), max
over ranks; the fastest and slowest rounds are reported as the spread.  Each commopt
schedule's output is checked against NCCL sequential's before it is timed.

Every variant is timed twice: eager (each call pays its host cost: short shapes measure the
host, not the GPUs) and replayed from a CUDA graph that holds the same back-to-back calls
(host cost gone: what `torch.compile(mode="reduce-overhead")` or a serving loop sees; the
pick is then the rule's with Config.cuda_graphs).  A variant whose capture fails on any rank
is reported as not capturable.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/bench_matmul_collectives.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import random
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch_commopt  # noqa: E402,F401
from benchmarks.common import fmt as _f  # noqa: E402
from benchmarks.common import git_commit, machine_meta, result_stem, write_report  # noqa: E402
from benchmarks.gpu_clocks import ClockSampler  # noqa: E402
from torch_commopt.core.schedule import Schedule  # noqa: E402
from torch_commopt.kernels.gpu.call_graphs import per_call  # noqa: E402
from torch_commopt.kernels.matmul.gpu.pick import call_graphs_pay, measure_band, pick  # noqa: E402
from torch_commopt.testing.launch import run_distributed  # noqa: E402
from torch_commopt.tuner.matmul.autotune import (  # noqa: E402
    TuneSite,
    band_request,
    capture_agreed,  # noqa: E402
    decided,
    host_measurement,
    measurement,
)
from torch_commopt.tuner.matmul.model import RegionFacts  # noqa: E402


@dataclass(frozen=True)
class Shape:
    op: str  # "ag" (weight column-sharded), "rs" / "ar" (weight row-sharded)
    M: int
    K: int
    N: int


SHAPES = [
    Shape("ag", 8192, 8192, 8192), Shape("ag", 16384, 8192, 8192),
    Shape("ag", 4096, 8192, 28672), Shape("ag", 16384, 8192, 28672),
    Shape("ag", 512, 8192, 8192), Shape("ag", 2048, 8192, 8192),
    Shape("rs", 8192, 8192, 8192), Shape("rs", 16384, 8192, 8192),
    Shape("rs", 4096, 8192, 7168), Shape("rs", 16384, 8192, 7168),
    Shape("rs", 512, 8192, 8192), Shape("rs", 2048, 8192, 8192),
    Shape("ar", 8192, 8192, 8192), Shape("ar", 2048, 8192, 8192),
]
SCHEDULES = {  # one or two piece counts per mechanism (the rest measured slower in earlier runs)
    "ag": ["local_first", "chunked:2", "ce_push:1", "ce_push:2", "ce_push:4", "ce_push:1:par=1", "ce_push:2:par=1",
           "fused:1", "fused:4", "ce_push:1:gemm=whole", "fused:1:tma=1", "fused:2:tma=1"],
    "rs": ["chunked:2", "ce_push:1", "ce_push:2", "ce_push:4", "ce_pull:2", "direct:1", "direct:2",
           "fused:2:store=direct", "fused:1:store=direct,tma=1", "fused:2:store=direct,tma=1"],
    "ar": ["chunked:2", "ce_push:1", "ce_push:2", "ce_push:4", "ce_pull:2", "direct:1", "direct:2"],
}
KIND = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar"}


# PyTorch's symm-mem recipes' fused all-gather + GEMM shapes (their 8x H100 figures are the TP=8
# anchor): Llama-3 8B, 70B and 105B projections, N and K a rank, M gathered 4096 / 8192 / 16384.
RECIPE_NK = ((1792, 4096), (3584, 8192), (6656, 16384))
RECIPE_M = (4096, 8192, 16384)


def shapes_for(world: int, recipes: bool = False) -> list[Shape]:
    """The sweep at `world` ranks: SHAPES, and above 2 ranks PyTorch async-TP's own AG+GEMM
    shape (M 16384, K 8192, N 3584 per rank; issue 8).  recipes: the symm-mem recipes' nine
    all-gather shapes instead, N a rank times the world."""
    if recipes:
        return [Shape("ag", m, k, n * world) for n, k in RECIPE_NK for m in RECIPE_M]
    return SHAPES + ([Shape("ag", 16384, 8192, 3584 * world)] if world > 2 else [])


def _repeat(fn, count: int) -> None:
    for _ in range(count):
        fn()


def _timed_all(fns: dict, iters: int, repeats: int, target_ms: float = 10.0, graphs: bool = False) -> dict:
    """{name: [ms per call in each round]}: mean of back-to-back calls, max over ranks.  A variant
    runs max(iters, target_ms / its time) calls per round (short calls are otherwise timed over a
    fraction of a millisecond), the same count on every rank.  Each round times every variant once,
    in an order shuffled per round (the same on every rank), so clock or thermal drift and the
    previous variant's leftovers spread evenly instead of favouring a fixed position.  graphs=True:
    the calls of a round are one replay of a CUDA graph holding them (variants that cannot be
    captured are missing from the result)."""
    counts = []
    for fn in fns.values():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        counts.append(max(iters, min(400, math.ceil(target_ms / max(start.elapsed_time(end) / 3, 1e-3)))))
    n = torch.tensor(counts, device="cuda")
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    counts = dict(zip(fns, n.tolist()))
    calls = dict(counts)  # calls of fn per timed sample
    if graphs:  # one replay of a graph holding counts[name] calls
        fns = capture_agreed({name: functools.partial(_repeat, fn, counts[name]) for name, fn in fns.items()})
        torch.cuda.synchronize()
        calls = {name: 1 for name in fns}
    samples = {name: [] for name in fns}
    for round_index in range(repeats):
        order = list(fns)
        random.Random(round_index).shuffle(order)
        for name in order:
            fn = fns[name]
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls[name]):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / counts[name])
    # Per round, the slowest rank's time of each variant: a call is done when every rank is.
    t = torch.tensor(list(samples.values()), device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(fns, t.tolist()))


def _rel(x, ref) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm()).item()


FLOAT8 = "float8_e4m3fn"
# float8 runs on cuBLAS's _scaled_mm: the Triton fused kernels and ce_pull (whose GEMM adds
# into its output) refuse it and would only time sequential again
FLOAT8_SKIPS = ("fused", "ce_pull")


def schedules_for(op: str, dtype: str) -> list[str]:
    return [s for s in SCHEDULES[op] if dtype != FLOAT8 or not s.startswith(FLOAT8_SKIPS)]


def overlap_floor(gemm, payload: torch.Tensor, pushes: int, group_name: str):
    """The overlap floor of one shape: `gemm` on the caller's stream while the copy engine
    pushes `payload` (this rank's piece of the collective, its real bytes) `pushes` times to
    every peer's symmetric buffer on a side stream, the two independent, joined at the end:
    an overlapped schedule's time with its protocol, waits and GEMM splits taken away.
    Its buffer is its own (runtime.own_buffer, allocated at the first call: collective, and
    every rank makes that call at the same point), not the size classes the schedules use."""
    from torch_commopt.kernels.gpu import symm

    payload = payload.contiguous().view(torch.uint8).view(-1)
    piece = payload.numel()
    dsts: list[torch.Tensor] = []

    def floor():
        rt = symm.runtime(group_name, payload.device)
        if not dsts:
            buf = rt.own_buffer("bench overlap floor", piece * rt.world)
            dsts.extend(buf.view(p, rt.rank * piece, (piece,), torch.uint8) for p in rt.peers)
        cur = torch.cuda.current_stream()
        rt.side.wait_stream(cur)
        for _ in range(pushes):
            for dst in dsts:
                rt.copy(rt.side, dst, payload)
        out = gemm()
        cur.wait_stream(rt.side)
        return out
    return floor


def _variants(shape: Shape, rank: int, world: int, group_name: str, dtype: str = "bfloat16"):
    """(inputs description for pick, gemm fn, comm fn, NCCL sequential fn, op fn (by schedule),
    torch async-TP fn or None, overlap floor fn)."""
    if dtype == FLOAT8:
        return _variants_float8(shape, rank, world, group_name)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    rnd = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    w_ = world
    if shape.op == "ag":
        shard, w = rnd(shape.M // w_, shape.K), rnd(shape.K, shape.N // w_) / math.sqrt(shape.K)
        full = torch.empty(shape.M, shape.K, device="cuda", dtype=torch.bfloat16)
        op = lambda s: torch.ops.commopt.ag_matmul(shard, [w], [None], 0, w_, group_name, s, False)[0]  # noqa: E731
        gemm = lambda: torch.mm(full, w)  # noqa: E731
        comm = lambda: dist.all_gather_into_tensor(full, shard)  # noqa: E731

        def seq():
            gathered = torch.empty(shape.M, shape.K, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(gathered, shard)
            return torch.mm(gathered, w)

        tp = lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [w], 0, group_name, return_A=False)[1][0]  # noqa: E731
        return ([shape.M // w_, shape.K], [[shape.K, shape.N // w_]], 0), gemm, comm, seq, op, tp, \
            overlap_floor(gemm, shard, 1, group_name)
    a, w = rnd(shape.M, shape.K // w_), rnd(shape.K // w_, shape.N) / math.sqrt(shape.K)
    t = torch.mm(a, w)
    gemm = lambda: torch.mm(a, w)  # noqa: E731
    if shape.op == "rs":
        part = torch.empty(shape.M // w_, shape.N, device="cuda", dtype=torch.bfloat16)
        op = lambda s: torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", w_, group_name, s)  # noqa: E731
        comm = lambda: dist.reduce_scatter_tensor(part, t)  # noqa: E731

        def seq():
            out = torch.empty(shape.M // w_, shape.N, device="cuda", dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(out, torch.mm(a, w))
            return out

        tp = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w, "sum", 0, group_name)  # noqa: E731
        return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], 0), gemm, comm, seq, op, tp, \
            overlap_floor(gemm, t[: shape.M // w_], 1, group_name)
    op = lambda s: torch.ops.commopt.matmul_ar(a, w, None, "sum", w_, group_name, s)  # noqa: E731
    comm = lambda: dist.all_reduce(t)  # noqa: E731

    def seq():
        out = torch.mm(a, w)
        dist.all_reduce(out)
        return out

    # an all-reduce moves its piece twice: the reduce-scatter's partials, the gathered sums
    return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], None), gemm, comm, seq, op, None, \
        overlap_floor(gemm, t[: shape.M // w_], 2, group_name)


def _variants_float8(shape: Shape, rank: int, world: int, group_name: str):
    """_variants of float8 (e4m3) operands with tensor-wise scales, bf16 products with fast
    accumulation (torchao's float8 forward).  NCCL moves the float8 bytes as uint8; torch
    async-TP's float8 ops are fused_all_gather_scaled_matmul / fused_scaled_matmul_reduce_scatter."""
    f8, bf, u8, w_ = torch.float8_e4m3fn, torch.bfloat16, torch.uint8, world
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    q = lambda *s: torch.randn(*s, generator=g, device="cuda").to(f8)  # noqa: E731
    sa, sb = torch.tensor(0.02, device="cuda"), torch.tensor(0.01, device="cuda")
    smm = lambda x, w: torch._scaled_mm(x, w, sa, sb, out_dtype=bf, use_fast_accum=True)  # noqa: E731
    ops = torch.ops.commopt
    if shape.op == "ag":
        shard, w = q(shape.M // w_, shape.K), q(shape.N // w_, shape.K).t()  # B column-major
        full = torch.empty(shape.M, shape.K, device="cuda", dtype=f8)
        op = lambda s: ops.ag_matmul(shard, [w], [None], 0, w_, group_name, s, False, sa, [sb], bf, True)[0]  # noqa: E731
        comm = lambda: dist.all_gather_into_tensor(full.view(u8), shard.view(u8))  # noqa: E731

        def seq():
            gathered = torch.empty(shape.M, shape.K, device="cuda", dtype=f8)
            dist.all_gather_into_tensor(gathered.view(u8), shard.view(u8))
            return smm(gathered, w)

        def tp():
            return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                shard, [w], sa, [sb], 0, group_name, [None], [None], [bf], [True])[1][0]

        gemm = lambda: smm(full, w)  # noqa: E731
        return ([shape.M // w_, shape.K], [[shape.K, shape.N // w_]], 0), gemm, comm, seq, op, tp, \
            overlap_floor(gemm, shard, 1, group_name)
    a, w = q(shape.M, shape.K // w_), q(shape.N, shape.K // w_).t()
    t = smm(a, w)
    if shape.op == "rs":
        part = torch.empty(shape.M // w_, shape.N, device="cuda", dtype=bf)
        op = lambda s: ops.matmul_rs(a, w, None, 0, "sum", w_, group_name, s, sa, sb, bf, True)  # noqa: E731
        comm = lambda: dist.reduce_scatter_tensor(part, t)  # noqa: E731

        def seq():
            out = torch.empty(shape.M // w_, shape.N, device="cuda", dtype=bf)
            dist.reduce_scatter_tensor(out, smm(a, w))
            return out

        def tp():
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                a, w, sa, sb, "sum", 0, 0, group_name, [shape.M, shape.N], None, None, bf, True)

        gemm = lambda: smm(a, w)  # noqa: E731
        return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], 0), gemm, comm, seq, op, tp, \
            overlap_floor(gemm, t[: shape.M // w_], 1, group_name)
    op = lambda s: ops.matmul_ar(a, w, None, "sum", w_, group_name, s, sa, sb, bf, True)  # noqa: E731

    def seq():
        out = smm(a, w)
        dist.all_reduce(out)
        return out

    gemm = lambda: smm(a, w)  # noqa: E731
    return ([shape.M, shape.K // w_], [[shape.K // w_, shape.N]], None), gemm, lambda: dist.all_reduce(t), \
        seq, op, None, overlap_floor(gemm, t[: shape.M // w_], 2, group_name)


def _with_cg(op: str, scheds: list[str]) -> list[str]:
    """The schedules among `scheds` whose calls replay per call, with cg=1."""
    replayed = (per_call(KIND[op], Schedule.parse(s)) for s in scheds)
    return [str(s) for s in replayed if s.param("cg")]


def bench_worker(rank: int, world: int, shapes: list[Shape], iters: int, repeats: int, modes: tuple[str, ...],
                 partial_path: str | None = None, call_graphs: bool = False, dtype: str = "bfloat16"):
    """Per shape and mode: every variant timed round-robin.  Rank 0 appends each finished
    record to `partial_path` (JSON lines) so that a run cut short keeps what it measured.
    call_graphs (Config.call_graphs=True, --call-graphs): eager shapes whose GEMM is in the band
    run the pick with cg=1, as the compile pass then emits them, and every capturable GPU
    schedule is timed with cg=1 too."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group_name = dist.group.WORLD.group_name
    enable_symm_mem_for_group(group_name)
    records = []
    for shape in shapes:
        (a_shape, w_shapes, dim), gemm, comm, seq, op, tp, floor = _variants(shape, rank, world, group_name, dtype)
        rec = {"op": shape.op, "M": shape.M, "K": shape.K, "N": shape.N, "world": world, "dtype": dtype}
        ref = seq()
        if tp is not None and not _runs(tp):
            tp = None
        if not _runs(floor):  # its first call allocates its buffer (collective): here, on every rank at once
            floor = None
        scheds = ["sequential"] + schedules_for(shape.op, dtype)
        cg_pays = call_graphs and call_graphs_pay(KIND[shape.op], a_shape, w_shapes, world, dtype)
        cg_scheds = _with_cg(shape.op, schedules_for(shape.op, dtype)) if cg_pays else []
        rec["errors_vs_nccl"] = {s: _rel(op(s), ref) for s in scheds}
        for s in cg_scheds:  # a call's third sighting is its first replay (the second is the other half's)
            op(s)
            op(s)
            rec["errors_vs_nccl"][s] = _rel(op(s), ref)
        for mode in modes:
            graphs = mode == "graph"
            cg = cg_pays and not graphs
            chosen, why = pick(KIND[shape.op], a_shape, w_shapes, dim, world, dtype, graphs=graphs or cg)
            band = measure_band(KIND[shape.op], a_shape, w_shapes, dim, world, dtype, graphs=graphs or cg)
            if cg and chosen.is_gpu:
                chosen, why = chosen.with_params(cg=1), why + ": replayed per call (cg=1)"
            if band is not None:  # what the compile pass emits there: timed at the first call
                facts = RegionFacts(KIND[shape.op], a_shape, w_shapes, dim, world, dtype)
                site = TuneSite(group_name, None, f"{shape.op} {shape.M}x{shape.K}x{shape.N}")
                chosen = band_request(facts, torch.cuda.get_device_name(0), band, str(chosen), site, graphs=graphs)
                where = "replayed short all-gather" if graphs else "host-bound band"
                why += f": {where}, {', '.join(band)} timed at the first call"
            fns = {"gemm": gemm, "comm": comm, "nccl_seq": seq}
            if floor is not None:
                fns["overlap_floor"] = floor
            if tp is not None:
                fns["torch_async_tp"] = tp
            fns.update({f"sched {s}": (lambda s=s: op(s)) for s in scheds + (cg_scheds if cg else [])})
            kept = chosen.name == "sequential"
            if not kept:
                fns["pick"] = lambda c=str(chosen): op(c)
            with ClockSampler(enabled=rank == 0) as clocks:  # both GPUs, from rank 0
                rounds = _timed_all(fns, iters, repeats, graphs=graphs)
            if kept:
                # The compiled path keeps a region whose pick is sequential as the graph's own
                # collective + matmul (passes.pipeline._keep_as_compiled): the program that runs
                # is the NCCL + cuBLAS baseline itself, so its timing is that baseline's.
                rounds["pick"] = rounds["nccl_seq"]
            res = _summarize(rounds, shape, world)
            res["gpu_clocks"] = clocks.summary()
            res["commopt_schedule"], res["pick_reason"] = str(chosen), why
            if band is not None:
                res["commopt_schedule"] = f"measured: {decided(chosen)}"
                res["band_first_call_ms"] = measurement(chosen)  # what the first call saw
                res["band_first_call_host_ms"] = host_measurement(chosen)  # its enqueue times
            res["pick_runs"] = ("the NCCL sequential baseline (region kept as compiled)" if kept
                                else f"commopt op, {chosen}")
            _derive(res)
            if graphs:
                rec["graph"] = res
            else:
                rec.update(res)
            if rank == 0:
                print(f"[{mode}]", _row(rec, res), flush=True)
                print("   ", ", ".join(f"{k} {v:.3f}" for k, v in res["schedules"].items()), flush=True)
        _balanced(rec, world)
        records.append(rec)
        if partial_path and rank == 0:
            with open(partial_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return records


def _runs(fn) -> bool:
    """Whether a baseline runs on this torch (every rank must agree: one that fails on any is
    left out on all)."""
    try:
        fn()
        torch.cuda.synchronize()
        ok = 1
    except Exception as e:  # noqa: BLE001 - reported, the column stays empty
        print(f"baseline failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        ok = 0
    flag = torch.tensor([ok], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _summarize(rounds: dict, shape: Shape, world: int) -> dict:
    """Medians, spreads and the paired ratio of one timing mode."""
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    res = {"gemm_ms": ms["gemm"], "comm_ms": ms["comm"], "nccl_seq_ms": ms.get("nccl_seq"),
           "torch_async_tp_ms": ms.get("torch_async_tp"),
           "schedules": {k.removeprefix("sched "): v for k, v in ms.items() if k.startswith("sched ")},
           "commopt_ms": ms.get("pick"), "overlap_floor_ms": ms.get("overlap_floor")}
    # fastest and slowest round of each timing (max over ranks): the run-to-run spread
    res["round_range_ms"] = {("commopt" if k == "pick" else k): [min(v), max(v)] for k, v in rounds.items()}
    # Paired: the pick against the best baseline *of the same round*, median over rounds
    # (drift between rounds -- clocks, temperature -- cancels within a round).
    base = [rounds[k] for k in ("nccl_seq", "torch_async_tp") if k in rounds]
    if base and "pick" in rounds:
        best_in_round = [min(x) for x in zip(*base)]
        res["paired_speedup_vs_best_baseline"] = statistics.median(b / c for b, c in zip(best_in_round, rounds["pick"]))
    else:
        res["paired_speedup_vs_best_baseline"] = None
    # Paired hidden fraction: the formula on each round's own times, median over rounds.  On a
    # GEMM-dominated shape the medians' formula divides by a small difference (AG 16384x8192x28672:
    # 6.27 - 5.70 ms), so 1% of clock drift between two timings of the GEMM moves it by ~0.1;
    # within a round the four timings run close together (the GPUs sit at their power cap and
    # their clocks wander between rounds).
    if all(k in rounds for k in ("nccl_seq", "pick", "gemm", "comm")):
        per_round = [(n - c) / (n - max(g, m)) for n, c, g, m in zip(rounds["nccl_seq"], rounds["pick"], rounds["gemm"],
                                                                     rounds["comm"]) if n > max(g, m)]
        res["paired_hidden_fraction"] = statistics.median(per_round) if per_round else None
    else:
        res["paired_hidden_fraction"] = None
    # The same formula on the overlap floor's own rounds: the most an overlapped schedule could hide
    if all(k in rounds for k in ("nccl_seq", "overlap_floor", "gemm", "comm")):
        per_round = [(n - f) / (n - max(g, m)) for n, f, g, m in zip(rounds["nccl_seq"], rounds["overlap_floor"],
                                                                     rounds["gemm"], rounds["comm"]) if n > max(g, m)]
        res["paired_hidden_fraction_ceiling"] = statistics.median(per_round) if per_round else None
    else:
        res["paired_hidden_fraction_ceiling"] = None
    best = min(res["schedules"], key=res["schedules"].get) if res["schedules"] else None
    res["best_schedule"], res["best_schedule_ms"] = best, res["schedules"].get(best)
    flops = 2 * shape.M * shape.K * shape.N / world
    res["commopt_tflops"] = flops / (res["commopt_ms"] * 1e-3) / 1e12 if res["commopt_ms"] else None
    return res


def _derive(res: dict) -> None:
    seq, t = res["nccl_seq_ms"], res["commopt_ms"]
    floor = max(res["gemm_ms"], res["comm_ms"])
    ok = seq is not None and t is not None
    res["hidden_fraction"] = (seq - t) / (seq - floor) if ok and seq > floor else None
    over = res.get("overlap_floor_ms")
    res["hidden_fraction_ceiling"] = (seq - over) / (seq - floor) if over is not None and seq and seq > floor else None
    baselines = [x for x in (seq, res["torch_async_tp_ms"]) if x is not None]
    res["speedup_vs_best_baseline"] = min(baselines) / t if baselines and t else None
    tp = res["torch_async_tp_ms"]
    res["torch_async_tp_hidden_fraction"] = ((seq - tp) / (seq - floor) if tp is not None and seq and seq > floor
                                             else None)


def _balanced(rec: dict, world: int) -> None:
    n_local = rec["N"] // world if rec["op"] == "ag" else rec["N"]
    k_local = rec["K"] if rec["op"] == "ag" else rec["K"] // world
    rec["balanced"] = rec["M"] >= 8192 and (n_local >= 4096 if rec["op"] == "ag" else k_local >= 4096)


def _row(r: dict, res: dict) -> str:
    return (f"{r['op']:>2} {r['M']:>6} {r['K']:>5} {r['N']:>6} | gemm {_f(res['gemm_ms'])} comm {_f(res['comm_ms'])} "
            f"| nccl {_f(res['nccl_seq_ms'])} tp {_f(res['torch_async_tp_ms'])} | commopt {_f(res['commopt_ms'])} "
            f"({res['commopt_schedule']}) | hidden {_f(res['hidden_fraction'], 2)} speedup "
            f"{_f(res['speedup_vs_best_baseline'])} (paired {_f(res['paired_speedup_vs_best_baseline'])}) "
            f"| best {res['best_schedule']} {_f(res['best_schedule_ms'])} "
            f"| floor {_f(res.get('overlap_floor_ms'))} ceiling {_f(res.get('hidden_fraction_ceiling'), 2)}")


FLOAT8_NOTE = " (tensor-wise scales, bf16 products)"


def _report(records: list[dict], meta: dict) -> str:
    lines = [f"# matmul + collective on {meta['device']} x{meta['world']} ({meta['date']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, "
             f"{'bf16' if meta.get('dtype', 'bfloat16') == 'bfloat16' else meta['dtype'] + FLOAT8_NOTE}.", "",
             f"Command: `{meta['command']}`", ""]
    # (a --modes graph run has no eager figures at the record's top level)
    modes = [("eager", "Eager calls (each call pays its host cost)", lambda r: r if "gemm_ms" in r else None),
             ("graph", "CUDA-graph replay (the same back-to-back calls captured once)", lambda r: r.get("graph"))]
    for mode, title, get in modes:
        if not any(get(r) for r in records):
            continue
        lines += [f"## {title}", "",
                  "| op | M | K | N | GEMM | comm | NCCL seq | torch async-TP | commopt pick | schedule | hidden | "
                  "paired hidden | async-TP hidden | speedup vs best | paired speedup | best schedule (ms) | "
                  "balanced | overlap floor | hidden ceiling (paired) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in records:
            x = get(r)
            if not x:
                continue
            lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {_f(x['gemm_ms'])} | {_f(x['comm_ms'])} | "
                         f"{_f(x['nccl_seq_ms'])} | {_f(x['torch_async_tp_ms'])} | {_f(x['commopt_ms'])} | "
                         f"{x['commopt_schedule']} | {_f(x['hidden_fraction'])} | "
                         f"{_f(x.get('paired_hidden_fraction'))} | "
                         f"{_f(x['torch_async_tp_hidden_fraction'])} | "
                         f"{_f(x['speedup_vs_best_baseline'])} | {_f(x['paired_speedup_vs_best_baseline'])} | "
                         f"{x['best_schedule']} ({_f(x['best_schedule_ms'])}) | {r['balanced']} | "
                         f"{_f(x.get('overlap_floor_ms'))} | {_f(x.get('hidden_fraction_ceiling'))} "
                         f"({_f(x.get('paired_hidden_fraction_ceiling'))}) |")
        lines += ["", "Times in ms (mean of back-to-back calls, median of round-robin rounds, max over ranks); "
                  "'-': not measured (not capturable).",
                  "Pick `sequential`: the compiled path keeps such a region as the graph's own collective + "
                  "matmul, i.e. the NCCL sequential program itself, so the pick's time is that baseline's "
                  "(our op's own `sequential` path is listed with the schedules below). Pick `measured: X`: "
                  "the rule's host-bound band (pick.measure_band), timed at the region's first call "
                  "(tuner.autotune), which chose X; the pick's time includes resolving the placeholder. "
                  "A schedule with `cg=1` (eager, Config.call_graphs): each call replayed from a CUDA graph "
                  "captured at the call's second sighting (kernels/gpu/call_graphs.py).",
                  "speedup vs best = best baseline median / pick median; paired = median over rounds of "
                  "(best baseline in that round / pick in that round); paired hidden = median over rounds of "
                  "the hidden fraction of that round's own times.",
                  "Overlap floor: the GEMM alone with the collective's bytes pushed to the peers by the copy "
                  "engine beside it, independent of it (an all-reduce's twice); hidden ceiling: the hidden "
                  "fraction of that floor, the most an overlapped schedule moving those bytes over NVLink "
                  "can reach here ('-': not timed).", "",
                  f"### Spread ({mode}; fastest..slowest round, ms)", ""]
        for r in records:
            x = get(r)
            if not x:
                continue
            rr = x["round_range_ms"]
            cells = ", ".join(f"{k} {rr[k][0]:.3f}..{rr[k][1]:.3f}" for k in ("nccl_seq", "torch_async_tp", "commopt")
                              if k in rr)
            clocks = "; ".join(f"GPU {i} {c['sm_mhz_mean']:.0f} MHz [{c['sm_mhz_min']:.0f}..{c['sm_mhz_max']:.0f}], "
                               f"power-capped {c['power_capped_share']:.0%}"
                               for i, c in (x.get("gpu_clocks") or {}).items())
            lines.append(f"- {r['op']} {r['M']}x{r['K']}x{r['N']}: {cells}"
                         + (f" (clocks while timed: {clocks})" if clocks else ""))
        lines += ["", f"### Every commopt schedule ({mode}; ms, relative error vs NCCL sequential)", ""]
        for r in records:
            x = get(r)
            if not x:
                continue
            cells = ", ".join(f"`{s}` {t:.3f} ({r['errors_vs_nccl'][s]:.1e})" for s, t in x["schedules"].items())
            lines.append(f"- {r['op']} {r['M']}x{r['K']}x{r['N']}: {cells}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--only", default="", help="comma-separated ops (ag,rs,ar) to run")
    parser.add_argument("--commit", default="")
    parser.add_argument("--modes", default="eager,graph", help="timing modes: eager, graph (CUDA-graph replay)")
    parser.add_argument("--m", default="", help="comma-separated global M values to run (default: every shape)")
    parser.add_argument("--call-graphs", action="store_true",
                        help="eager picks as with Config.call_graphs=True (per-call graphs, cg rows)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", FLOAT8],
                        help=f"{FLOAT8}: float8 operands with tensor-wise scales, bf16 products (_scaled_mm)")
    parser.add_argument("--recipes", action="store_true",
                        help="the symm-mem recipes' nine all-gather + GEMM shapes (N a rank 1792 / 3584 / 6656, "
                             "K 4096 / 8192 / 16384, M 4096-16384) instead of the sweep; a report of its own")
    args = parser.parse_args()
    shapes = [s for s in shapes_for(args.world, args.recipes) if (not args.only or s.op in args.only.split(","))
              and (not args.m or str(s.M) in args.m.split(","))]
    modes = tuple(m for m in args.modes.split(",") if m)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_rank = run_distributed(bench_worker, args.world, shapes, args.iters, args.repeats, modes,
                               str(out / "partial.jsonl"), args.call_graphs, args.dtype, backend="nccl",
                               timeout_s=1800)
    records = per_rank[0]
    meta = machine_meta(torch.cuda.get_device_name(0), args.world, args.commit or git_commit(), dtype=args.dtype)
    stem = result_stem("matmul_collectives", meta["device"], args.world, meta["date"],
                       variant="_".join(v for v in ("float8" if args.dtype == FLOAT8 else "",
                                                    "recipes" if args.recipes else "") if v))
    tagged = [dict(r, device=meta["device"], torch=meta["torch"], triton=meta["triton"], commit=meta["commit"],
                   date=meta["date"]) for r in records]
    write_report(out, stem, tagged, _report(records, meta))
    print(_report(records, meta))


if __name__ == "__main__":
    main()
