"""Decode-sized GEMM + all-reduce: NCCL against the low-latency one-shot and two-shot all-reduces.

(a) of issue 69: the row-parallel projections of a tensor-parallel decoder at M = 1 .. 512 rows,
Llama-3-8B's and -70B's o_proj and down_proj with K split over W ranks, bf16.  Every variant runs
as a decoder runs it, from a CUDA graph: 64 calls captured once, the graph replayed `--rounds`
times in turns with the other variants; ms per call is the median over rounds, the slowest rank.
- `gemm`: the GEMM alone, no all-reduce (the floor);
- `nccl`: commopt's `sequential` (cuBLAS, then NCCL's all-reduce), what inductor runs;
- `symm_mem`: the GEMM, then torch's symm_mem one-shot all-reduce (`torch.ops.symm_mem
  .one_shot_all_reduce` on a rendezvoused buffer), where this torch has it;
- `oneshot`, `twoshot`: commopt's low-latency schedules (kernels/matmul/gpu/lowlat_ar.py);
- `commopt`: commopt's pick, as a compiled replayed region gets it (pick.measure_band and
  pick.pick with graphs=True): in the low-latency band a first-call measurement of NCCL, oneshot
  and twoshot as graph replays (the warm-up call below makes it), else the rule's schedule.
Per case: each variant's ms, the speedup over NCCL and over the best baseline (NCCL, symm_mem), the
ceiling a perfect all-reduce could reach ((gemm + NCCL's all-reduce) / gemm, with NCCL's
all-reduce time taken as nccl - gemm), and whether every variant agreed with NCCL (bf16 relative
error ≤ 1e-2; oneshot and twoshot also equal on every rank, bit for bit).

    python3 -m benchmarks.bench_decode --out OUT [--world 2] [--rounds 15]   # W GPUs (NCCL)
    python3 -m benchmarks.bench_decode --cpu                                   # gloo smoke, tiny shapes

(b), `--step`: a whole decoder step of a Llama-3-8B-shaped model at TP=W, every variant replayed
from CUDA graphs (benchmarks/decode_step.py: the model, the variants, the figures):

    python3 -m benchmarks.bench_decode --step --out OUT [--world 2] [--layers 32] [--batch 1,8,32]
        [--ctx 4096,32768] [--variants ...] [--rounds 15] [--steps 10]     # W GPUs (NCCL)
    python3 -m benchmarks.bench_decode --step --shared --out OUT           # 2 ranks on one GPU (gloo)
    python3 -m benchmarks.bench_decode --step --cpu                        # gloo smoke, tiny dims
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks import decode_step
from benchmarks.common import fmt, machine_meta, max_over_ranks, result_stem, schedule_ran, write_report

# (model, projection, K over all ranks, N)
PROJECTIONS = [("llama3-8b", "o_proj", 4096, 4096), ("llama3-8b", "down_proj", 14336, 4096),
               ("llama3-70b", "o_proj", 8192, 8192), ("llama3-70b", "down_proj", 28672, 8192)]
ROWS = (1, 8, 32, 128, 512)
CPU_PROJECTIONS = [("tiny", "o_proj", 64, 48)]
CALLS = 64  # per captured graph


def _variants(cuda: bool) -> list[str]:
    return ["gemm", "nccl", "symm_mem", "oneshot", "twoshot", "commopt"] if cuda else ["gemm", "nccl", "gather_sum",
                                                                                      "scatter_gather"]


def _commopt_pick(a, w, world: int, group_name: str) -> str:
    """The schedule commopt gives this region replayed from CUDA graphs: the rule's, or in its
    band a first-call measurement placeholder (tuner.matmul.autotune.band_request), resolved at
    the region's first call."""
    import torch

    from torch_commopt.kernels.matmul.gpu.pick import measure_band, pick
    from torch_commopt.tuner.machine import device_name
    from torch_commopt.tuner.matmul.autotune import TuneSite, band_request
    from torch_commopt.tuner.matmul.model import RegionFacts

    dtype = str(a.dtype).removeprefix("torch.")
    shape, weights = list(a.shape), [list(w.shape)]
    rule, _ = pick("matmul_ar", shape, weights, None, world, dtype, graphs=True)
    band = measure_band("matmul_ar", shape, weights, None, world, dtype, graphs=True)
    if band is None:
        return str(rule)
    facts = RegionFacts("matmul_ar", shape, weights, None, world, dtype)
    site = TuneSite(group_name, None, f"decode {'x'.join(map(str, shape))}x{w.shape[-1]}")
    return str(band_request(facts, device_name(torch.device("cuda", torch.cuda.current_device())), band, str(rule),
                            site, graphs=True))


def _runner(variant: str, a, w, group, world: int, symm_buf):
    """A call of `variant` (returns its output)."""
    import torch

    if variant == "gemm":
        return lambda: torch.mm(a, w)
    if variant == "symm_mem":
        def call():
            torch.mm(a, w, out=symm_buf)
            return torch.ops.symm_mem.one_shot_all_reduce(symm_buf, "sum", group.group_name)
        return call
    schedule = {"nccl": "sequential", "commopt": None}.get(variant, variant)
    if schedule is None:
        schedule = _commopt_pick(a, w, world, group.group_name)

    def call():
        return torch.ops.commopt.matmul_ar(a, w, None, "sum", world, group.group_name, schedule)

    call.schedule = schedule
    return call


def _symm_mem_buffer(shape, dtype, device, group):
    """A buffer rendezvoused by torch's symmetric memory for its one-shot all-reduce, or None where
    this torch or this group has none (the variant is then reported as not run)."""
    try:
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
            return None
        buf = symm_mem.empty(shape, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        return buf
    except Exception as e:  # noqa: BLE001  (no symmetric memory here: a baseline not run, said in the report)
        print(f"symm_mem baseline not run: {type(e).__name__}: {e}", flush=True)
        return None


def _rank(rank: int, world: int, projections: list, rows_list: tuple, rounds: int, cuda: bool):
    import torch
    import torch.distributed as dist

    import torch_commopt  # noqa: F401  (registers the ops)

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    group = dist.group.WORLD
    variants = _variants(cuda)
    cases = []
    for model, proj, k_all, n in projections:
        k = k_all // world
        for m in rows_list:
            g = torch.Generator(device=device).manual_seed(1000 * m + rank)
            a = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            w = torch.randn(k, n, device=device, dtype=dtype, generator=g) / k ** 0.5
            symm_buf = _symm_mem_buffer((m, n), dtype, device, group) if cuda else None
            runs, outs, picked = {}, {}, None
            for v in variants:
                if v == "symm_mem" and symm_buf is None:
                    continue
                call = _runner(v, a, w, group, world, symm_buf)
                outs[v] = call().clone()  # warm-up, and the output compared (and commopt's first call)
                if v == "commopt":
                    picked = schedule_ran(call.schedule)
                if cuda:
                    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(stream):
                        call()
                        with torch.cuda.graph(graph, stream=stream):
                            for _ in range(CALLS):
                                call()
                    torch.cuda.current_stream(device).wait_stream(stream)
                    runs[v] = graph.replay
                else:
                    runs[v] = lambda call=call: [call() for _ in range(4)]
            times = {v: [] for v in runs}
            order = list(runs)
            for r in range(rounds):
                for v in order[r % len(order):] + order[: r % len(order)]:  # rotated each round
                    dist.barrier()
                    if cuda:
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        runs[v]()
                        end.record()
                        end.synchronize()
                        times[v].append(start.elapsed_time(end) / CALLS)
                    else:
                        import time

                        t0 = time.perf_counter()
                        runs[v]()
                        times[v].append((time.perf_counter() - t0) / 4 * 1e3)
            med = {v: statistics.median(t) for v, t in times.items()}
            slowest = dict(zip(med, max_over_ranks(list(med.values()), device if cuda else "cpu")))
            ref = outs["nccl"].float()
            errors = {v: ((o.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                      for v, o in outs.items() if v != "gemm"}
            # the low-latency results: the same bits on every rank
            same = {}
            for v in ("oneshot", "twoshot", "gather_sum", "scatter_gather"):
                if v in outs:
                    mine = outs[v].view(-1).float()
                    gathered = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(gathered, mine)
                    same[v] = all(torch.equal(x, gathered[0]) for x in gathered)
            cases.append({"model": model, "projection": proj, "k_per_rank": k, "n": n, "rows": m,
                          "ms": slowest, "raw_ms": times, "max_rel_error_vs_nccl": errors, "same_on_every_rank": same,
                          "commopt_pick": picked})
    name = torch.cuda.get_device_name(device) if cuda else "cpu (gloo)"
    return cases, name


def records(cases: list) -> list:
    """Each case with its derived figures (from the raw times only)."""
    for c in cases:
        ms = c["ms"]
        nccl, gemm = ms["nccl"], ms["gemm"]
        baselines = [ms[v] for v in ("nccl", "symm_mem") if v in ms]
        best = min(baselines)
        c["speedup_vs_nccl"] = {v: nccl / t for v, t in ms.items() if v != "gemm"}
        c["speedup_vs_best_baseline"] = {v: best / t for v, t in ms.items() if v != "gemm"}
        c["ceiling_vs_nccl"] = nccl / gemm if gemm > 0 else None  # an all-reduce that cost nothing
        c["agree"] = all(e <= 1e-2 for e in c["max_rel_error_vs_nccl"].values()) and all(c["same_on_every_rank"].values())
    return cases


def report(cases: list, meta: dict) -> str:
    variants = list(dict.fromkeys(v for c in cases for v in c["ms"]))
    mine = [v for v in variants if v in ("oneshot", "twoshot", "commopt", "gather_sum", "scatter_gather")]
    lines = [f"# Decode-sized GEMM + all-reduce ({meta['device']}, {meta['world']} ranks)", "",
             f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}; ms per call, {CALLS} calls per CUDA "
             f"graph, median of {meta['rounds']} rounds, the slowest rank; variants in rotated order.", "",
             "| model | projection | K/rank x N | rows | " + " | ".join(f"{v} ms" for v in variants)
             + " | " + " | ".join(f"{v} × NCCL" for v in mine) + " | commopt × best baseline | ceiling × NCCL | agree "
             "| commopt's pick |",
             "|---|---|---|---|" + "---|" * (len(variants) + len(mine) + 4)]
    for c in cases:
        lines.append(f"| {c['model']} | {c['projection']} | {c['k_per_rank']}x{c['n']} | {c['rows']} | "
                     + " | ".join(fmt(c["ms"].get(v), 4) for v in variants) + " | "
                     + " | ".join(fmt(c["speedup_vs_nccl"].get(v), 2) for v in mine)
                     + f" | {fmt(c['speedup_vs_best_baseline'].get('commopt'), 2)}"
                     + f" | {fmt(c['ceiling_vs_nccl'], 2)} | {'yes' if c['agree'] else 'NO'} | {c.get('commopt_pick') or '-'} |")
    lines += ["", "× NCCL: speedup over `nccl`; × best baseline: over the faster of `nccl` and `symm_mem` (the "
              "issue's targets on 2 GPUs: commopt >= 1.00x the best baseline everywhere, >= 1.5x NCCL at M <= 32).", "",
              "× NCCL: speedup over `nccl`. Ceiling: what an all-reduce costing nothing would reach (nccl / gemm). "
              "Agree: every variant within 1e-2 of NCCL, the low-latency ones equal on every rank.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for the report (required except with --cpu)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cpu", action="store_true", help="gloo smoke run, tiny shapes; prints, writes nothing")
    p.add_argument("--commit", default="")
    decode_step.add_arguments(p)
    args = p.parse_args()
    if args.step:
        decode_step.main_step(args)
        return

    from torch_commopt.testing.launch import run_distributed

    if args.cpu:
        per_rank = run_distributed(_rank, args.world, CPU_PROJECTIONS, (1, 3), 2, False, backend="gloo", timeout_s=300)
    else:
        per_rank = run_distributed(_rank, args.world, PROJECTIONS, ROWS, args.rounds, True, backend="nccl",
                                   timeout_s=560)
    cases, device = per_rank[0]
    meta = machine_meta(device, args.world, args.commit, rounds=2 if args.cpu else args.rounds)
    text = report(records(cases), meta)
    print(text)
    if args.out and not args.cpu:
        write_report(args.out, result_stem("decode_gemm_ar", device, args.world), {"meta": meta, "cases": cases}, text)


if __name__ == "__main__":
    main()
