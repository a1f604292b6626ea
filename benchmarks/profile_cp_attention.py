"""Two or more GPUs: where a context-parallel attention schedule's time goes (torch.profiler).

bench_attention.py (2x H200, 2026-11-23) measured ring_zigzag on a contiguous program 3.5 ms
slower than the same ring on zigzag shards (16K tokens, MHA, fwd+bwd), where the relayout
bytes predict ~1.3 ms, and the zigzag-layout ring 1.2 ms slower than its per-rank compute
alone.  This runs each variant fwd+bwd on one shape, times it (back-to-back calls, slowest
rank), then profiles a few calls per rank and writes, per variant and rank, the kernel table
(device time by kernel, NCCL separately) and the busy time of the compute stream, so the
exposed communication, the relayout copies and the NCCL kernels' share of the SMs can be
read off.  Variants (any subset with --variants):

    zigzag_g1   ring_zigzag on contiguous shards, relayouts not pipelined (head_groups=1)
    zigzag_g2   the same, relayouts pipelined over two head groups (what the op picks at
                >= 32 MiB of q per group)
    zigzag_lay  ring_zigzag on zigzag shards (layout="zigzag"): no relayouts
    ulysses     all-to-all to heads, full attention on H/W heads, all-to-all back (its
                head groups by spec.ulysses_head_groups; ulysses_g1/g2/g4: 1, 2, 4 forced)
    ulysses_early  ulysses:early (attention/own_first.py): the own block first, pieces back early
    ring        the contiguous ring (causal imbalance)

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/profile_cp_attention.py OUTDIR [--seq 16384] [--heads 32/32] [--world 2]

Writes OUTDIR/cp_profile.json (times, per-variant kernel totals per rank) and
OUTDIR/cp_profile_<variant>_rank<r>.txt (kernel tables) and OUTDIR/cp_timeline_<variant>_rank<r>.json
(attention_gaps: the stretches where no attention kernel ran on any stream, and what the device
did meanwhile; host_ops: who called cat / copy_ / add_ ..., with input shapes and the commopt
frames; --host-ops only; events: every kernel and copy of the profiled calls as [start us from the
first, duration us, stream, name]); each variant's "host" figures say whether the call is host-bound
(enqueue time, cudaMalloc/cudaFree per call); --cprofile adds OUTDIR/cp_cprofile_<variant>_rank<r>.txt;
--trace adds chrome traces.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_commopt.launch import run_distributed  # noqa: E402

VARIANTS = {"zigzag_g1": ("ring_zigzag", "contiguous", 1), "zigzag_g2": ("ring_zigzag", "contiguous", 2),
            "zigzag_lay": ("ring_zigzag", "zigzag", None), "ulysses": ("ulysses", "contiguous", None),
            "ulysses_g1": ("ulysses", "contiguous", 1), "ulysses_g2": ("ulysses", "contiguous", 2),
            "ulysses_g4": ("ulysses", "contiguous", 4), "ulysses_early": ("ulysses:early", "contiguous", None),
            "ring": ("ring", "contiguous", None)}


def _shard(t: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    """This rank's part along dim 2: contiguous, or zigzag (chunks r and 2W-1-r of 2W)."""
    if layout == "contiguous":
        return t.chunk(world, dim=2)[rank].contiguous()
    chunks = t.chunk(2 * world, dim=2)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=2).contiguous()


def _step(schedule: str, layout: str, head_groups, q, k, v, dout, group):
    """One fwd+bwd call of the schedule's ops (the autograd wrapper's two halves: the kept
    pair for a schedule that moves its inputs)."""
    from torch_commopt.attention import schedules

    kw = dict(schedule=schedule, causal=True, group=group, layout=layout, head_groups=head_groups)
    if schedules.moves_inputs(schedule, group.size(), True, layout):  # the training form, as cp_attention runs it
        del kw["layout"]

        def step():
            _, kept = schedules.cp_attention_fwd_keep(q, k, v, **kw)
            return schedules.cp_attention_bwd_kept(dout, kept, **{n: kw[n] for n in kw if n != "head_groups"})
        return step

    def step():
        out, lse = schedules.cp_attention_fwd(q, k, v, **kw)
        return schedules.cp_attention_bwd(dout, q, k, v, out, lse, **kw)
    return step


def _graphed(step):
    """step captured once in a CUDA graph (after two warm-up calls on a side stream, as
    torch.cuda.graphs asks): its replay, without the host's per-op cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


ALLOC_KEYS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries", "num_sync_all_streams")


def _host(step, sync, dev: str, calls: int = 10) -> dict:
    """The host side of one call: its enqueue time (ms, median over calls, each started on an
    idle device) and what the caching allocator did per call over `calls` back-to-back calls
    (cudaMalloc / cudaFree segments, retries after a failed allocation, whole-device syncs): a
    call whose enqueue reaches its device time is host-bound."""
    enqueue = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        step()
        enqueue.append((time.perf_counter() - t0) * 1e3)
    sync()
    got = {"enqueue_ms": round(statistics.median(enqueue), 3)}
    if dev == "cuda":
        before = torch.cuda.memory_stats()
        for _ in range(calls):
            step()
        sync()
        after = torch.cuda.memory_stats()
        got.update({k: (after.get(k, 0) - before.get(k, 0)) / calls for k in ALLOC_KEYS})
    return got


def _host_ops(step, sync, calls: int = 10) -> dict:
    """Host time per call of each driver-level operation a call makes (the copy-engine copies,
    stream memory operations, events, record_stream, the local attention's kernels' launches),
    by wrapping them for `calls` back-to-back calls: per op, calls, total and the largest single
    call (ms per step), and the ten slowest single calls -- one that blocks shows here."""
    import dataclasses

    from torch_commopt.attention import local
    from torch_commopt.kernels.gpu import driver

    times: dict[str, list[float]] = {}
    order = []

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = (time.perf_counter() - t0) * 1e3
                times.setdefault(name, []).append(dt)
                order.append((dt, name, len(order)))
        return wrapper

    patched = [(driver, n, getattr(driver, n)) for n in ("memcpy2d_async", "memcpy_async", "write_value32",
                                                          "wait_value32", "batch", "record", "wait_event")]
    patched += [(torch.cuda.Stream, n, getattr(torch.cuda.Stream, n)) for n in ("record_event", "wait_event")]
    patched += [(torch.Tensor, "record_stream", torch.Tensor.record_stream)]
    saved = local.backends()
    try:
        for owner, n, fn in patched:
            setattr(owner, n, timed(n, fn))
        for n, b in saved.items():
            local._REGISTRY[n] = dataclasses.replace(b, fwd=timed(f"{n} fwd", b.fwd), bwd=timed(f"{n} bwd", b.bwd))
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        wall = (time.perf_counter() - t0) * 1e3
        sync()
    finally:
        for owner, n, fn in patched:
            setattr(owner, n, fn)
        local._REGISTRY.update(saved)
    per = {n: {"calls": len(v) / calls, "ms": round(sum(v) / calls, 3), "max_ms": round(max(v), 3)}
           for n, v in sorted(times.items(), key=lambda kv: -sum(kv[1]))}
    return {"enqueue_ms": round(wall / calls, 3), "timed_ops_ms": round(sum(sum(v) for v in times.values()) / calls, 3),
            "ops": per, "slowest": [{"ms": round(dt, 3), "op": n, "at": i} for dt, n, i in sorted(order)[-10:][::-1]]}


def _cprofiled(step, sync, out: pathlib.Path, name: str, rank: int, calls: int = 5) -> None:
    """cProfile of `calls` back-to-back calls (host functions by their own time) -> a text file."""
    import cProfile
    import io
    import pstats

    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    (out / f"cp_cprofile_{name}_rank{rank}.txt").write_text(text.getvalue())


def _timed(step, sync, dev: str, calls: int = 10, rounds: int = 3) -> float:
    step()
    sync()
    samples = []
    for _ in range(rounds):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e3)
    ms = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=dev)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _profile(step, sync, out: pathlib.Path, name: str, rank: int, trace: bool, host_ops_too: bool = False,
             steady: bool = False) -> dict:
    """steady: the profiled calls follow WARM back-to-back calls under the running profiler
    (recorded from the first profiled call on, no synchronize between), so the device is in
    its back-to-back state rather than starting each profiled span idle."""
    from torch.profiler import ProfilerActivity, profile, schedule

    sync()
    dist.barrier()
    # input shapes and Python frames slow the host several-fold: only with --host-ops, whose
    # timelines are then host-bound (session 30: 16K spans 8.6-18 ms a call against 8.2-9.9 timed)
    # and host-op tracing alone slows it enough to bend the device timeline: device activity only
    # unless the host ops are asked for
    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] if host_ops_too or not on_cuda else []
    activities += [ProfilerActivity.CUDA] if on_cuda else []
    plan = schedule(wait=0, warmup=WARM, active=STEPS, repeat=1) if steady else None
    with profile(activities=activities, record_shapes=host_ops_too, with_stack=host_ops_too, schedule=plan) as prof:
        for _ in range(STEPS + (WARM if steady else 0)):
            step()
            if steady:
                prof.step()
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
    (out / f"cp_profile_{name}_rank{rank}.txt").write_text(table + "\n")
    if trace:
        prof.export_chrome_trace(str(out / f"cp_trace_{name}_rank{rank}.json"))
    on_device = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                        and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    device = [(e.name, e.time_range.start, e.time_range.end) for e in on_device]
    t0 = on_device[0].time_range.start if on_device else 0.0
    events = [[round(e.time_range.start - t0, 1), round(e.time_range.end - e.time_range.start, 1),
               getattr(e, "device_resource_id", None), e.name[:48]] for e in on_device]
    (out / f"cp_timeline_{name}_rank{rank}.json").write_text(json.dumps(
        {"attention_gaps": attention_gaps(device, STEPS), "host_ops": host_ops(prof.events()) if host_ops_too else {},
         "events": events}, indent=0))
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = evt.self_device_time_total / 1e3 / STEPS
        key = evt.key.lower()
        cat = ("nccl" if "nccl" in key else "attention" if any(s in key for s in ("cudnn", "flash", "fmha", "sdpa"))
               else "merge" if "merge" in key else "copy" if any(s in key for s in ("memcpy", "copy", "cat"))
               else "other")
        totals[cat] = totals.get(cat, 0.0) + ms
    return {k: round(v, 3) for k, v in sorted(totals.items())}


STEPS = 3  # profiled calls per variant
WARM = 4  # --steady: back-to-back calls before the profiled ones
ATTENTION_KEYS = ("cudnn", "flash", "fmha", "sdpa")
HOST_OPS = ("aten::cat", "aten::copy_", "aten::add_", "aten::zeros", "aten::to")  # whose callers host_ops names


def _is_attention(name: str) -> bool:
    return any(s in name.lower() for s in ATTENTION_KEYS)


def attention_gaps(events: list[tuple[str, float, float]], steps: int, top: int = 12) -> dict:
    """Where no attention kernel ran (on any stream) within the profiled span, and what the
    device did meanwhile: events (name, start_us, end_us) of every kernel and copy.  Returns
    per call: the span, the attention's union, the gaps' total, the other work overlapping the
    gaps by name (ms per call), and the largest gaps with their neighbours and overlapping work."""
    if not events:
        return {}
    att = sorted((lo, hi, n) for n, lo, hi in events if _is_attention(n))
    t0, t1 = min(lo for _, lo, _ in events), max(hi for _, _, hi in events)
    gaps, last, last_name = [], t0, "(start)"
    for lo, hi, n in att:
        if lo > last:
            gaps.append((last, lo, last_name, n))
        if hi > last:
            last, last_name = hi, n
    if t1 > last:
        gaps.append((last, t1, last_name, "(end)"))
    def overlap(lo: float, hi: float) -> dict[str, float]:
        got: dict[str, float] = {}
        for n, a, b in events:
            if _is_attention(n) or b <= lo or a >= hi:
                continue
            key = n if len(n) <= 60 else n[:57] + "..."
            got[key] = got.get(key, 0.0) + min(b, hi) - max(a, lo)
        return got
    during: dict[str, float] = {}
    for lo, hi, _, _ in gaps:
        for k, v in overlap(lo, hi).items():
            during[k] = during.get(k, 0.0) + v
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    per = 1e3 * steps
    return {"span_ms": round((t1 - t0) / per, 3), "attention_busy_ms": round(
        (t1 - t0 - sum(hi - lo for lo, hi, _, _ in gaps)) / per, 3),
        "gaps_ms": round(sum(hi - lo for lo, hi, _, _ in gaps) / per, 3), "gaps": len(gaps) / steps,
        "during_gaps_ms": {k: round(v / per, 4) for k, v in sorted(during.items(), key=lambda kv: -kv[1])[:top]},
        "largest": [{"at_ms": round((lo - t0) / 1e3, 3), "us": round(hi - lo, 1), "before": b[:60], "after": a[:60],
                     "during_us": {k: round(v, 1) for k, v in sorted(overlap(lo, hi).items(), key=lambda kv: -kv[1])[:4]}}
                    for lo, hi, b, a in largest]}


def host_ops(events) -> dict:
    """Per op of HOST_OPS: calls, device-side child time and the distinct (input shapes,
    innermost commopt / benchmark stack frames) it was called with."""
    got: dict[str, dict] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name not in HOST_OPS:
            continue
        frames, parent = [], e.cpu_parent  # with_stack: the Python frames are the op's ancestors
        while parent is not None and len(frames) < 4:
            if "torch_commopt" in parent.name or "benchmarks" in parent.name:
                frames.append(parent.name.rsplit("/", 1)[-1])
            parent = parent.cpu_parent
        key = f"{e.name} {e.input_shapes} <- {' <- '.join(frames)}"
        row = got.setdefault(key, {"calls": 0, "device_us": 0.0})
        row["calls"] += 1
        row["device_us"] += getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
    return dict(sorted(got.items(), key=lambda kv: -kv[1]["device_us"])[:20])


def worker(rank: int, world: int, args) -> dict:
    import torch_commopt  # noqa: F401  (registers the ops)

    dev = "cpu" if args.cpu else "cuda"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    out = pathlib.Path(args.out)
    h, h_kv = (int(x) for x in args.heads.split("/"))
    g = torch.Generator(device=dev).manual_seed(7)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    full = {n: torch.randn(args.batch, hh, args.seq, args.head_dim, generator=g, device=dev, dtype=dtype)
            for n, hh in (("q", h), ("k", h_kv), ("v", h_kv), ("dout", h))}
    group, sync = dist.group.WORLD, (torch.cuda.synchronize if dev == "cuda" else (lambda: None))
    res = {}
    for name in args.variants.split(","):
        schedule, layout, head_groups = VARIANTS[name]
        local = {n: _shard(t, rank, world, layout) for n, t in full.items()}
        step = _step(schedule, layout, head_groups, local["q"], local["k"], local["v"], local["dout"], group)
        if args.graphs and dev == "cuda":
            step = _graphed(step)
        res[name] = {"ms": _timed(step, sync, dev), "host": _host(step, sync, dev),
                     "device_ms_by_kind": _profile(step, sync, out, name, rank, args.trace, args.host_ops,
                                                        args.steady)}
        if args.cprofile:
            _cprofiled(step, sync, out, name, rank)
        if args.host_timing:
            res[name]["host_ops"] = _host_ops(step, sync)
        if rank == 0:
            print(name, json.dumps(res[name]), flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", default="32/32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--trace", action="store_true", help="also write chrome traces (large)")
    ap.add_argument("--host-ops", dest="host_ops", action="store_true",
                    help="record who called cat / copy_ / ... (input shapes, Python frames; slows the host)")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile a few calls per variant and rank")
    ap.add_argument("--host-timing", dest="host_timing", action="store_true",
                    help="host time of each driver-level operation of a call (wrapped)")
    ap.add_argument("--graphs", action="store_true", help="time and profile CUDA-graph replays (no host cost)")
    ap.add_argument("--steady", action="store_true",
                    help="profile calls that follow back-to-back calls (the device's steady state), not an idle start")
    ap.add_argument("--commit", default="")
    ap.add_argument("--cpu", action="store_true", help="gloo smoke run (use tiny --seq/--heads): the script's logic only")
    args = ap.parse_args()
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    per_rank = run_distributed(worker, args.world, args, backend="gloo" if args.cpu else "nccl", timeout_s=500)
    from torch_commopt.attention import ce_a2a
    from torch_commopt.attention.ce_ring import transport

    meta = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "world": args.world,
            "ring_transport": transport(), "a2a_transport": ce_a2a.transport(), "cuda_graphs": args.graphs, "torch": torch.__version__,
            "commit": args.commit, "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python3", *sys.argv])}
    data = {"meta": meta, "per_rank": per_rank}
    (pathlib.Path(args.out) / "cp_profile.json").write_text(json.dumps(data, indent=1))
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
