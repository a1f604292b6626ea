"""Probe: which passes of a two-group Ulysses call should run their head groups on two streams?

ce_a2a runs the odd head groups' attention on a second compute stream in the passes
TORCH_COMMOPT_ATTENTION_GROUP_STREAMS asks for ("1": both passes', the default; "fwd": the
forward's only; "0": neither).  This times the training pair
(cp_attention_fwd_keep / cp_attention_bwd_kept, eager, back to back, the compiled path's form)
at two head groups under each value, and at one head group for reference, in one process:
the switch is read per call, so every round visits every variant (in an order rotated per
round) and each variant's ratio to "fwd" is read per round (autotune.ratio_summary: the
median and its 95% CI), immune to the clocks' drift between rounds.  Also (session 51): "ahead1" /
"ahead2" keep the host at most one / two calls ahead of the device (an event synchronize per
call), "profiled" times the samples inside torch.profiler; and every sample records the device's
ms between the compute stream's arrivals at consecutive calls and the host's ms per call
(cycles_rank0: where a sample's time goes call by call).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_group_streams.py OUTDIR [--seq 16384,32768] [--heads 32/32,32/8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_commopt.launch import run_distributed  # noqa: E402

# name -> (head groups, GROUP_STREAMS_ENV value, calls the host may queue beyond the one running: 0
# unbounded); --variants picks a subset (the reference always runs)
VARIANTS = {"g2 fwd": (2, "fwd", 0), "g2 both": (2, "1", 0), "g2 none": (2, "0", 0), "g1": (1, "1", 0),
            "g2 both ahead1": (2, "1", 1), "g2 both ahead2": (2, "1", 2), "g2 both profiled": (2, "1", 0)}
PROFILED = {"g2 both profiled"}  # timed inside torch.profiler (CUDA activities, nothing exported)
REFERENCE = "g2 both"  # the default (session 45's run read its ratios to "g2 fwd", then the candidate default)


def _switch(name: str) -> None:
    """The variant's switch, which ce_a2a reads per call."""
    from torch_commopt.attention import ce_a2a

    os.environ[ce_a2a.GROUP_STREAMS_ENV] = VARIANTS[name][1]


def _timed_rounds(steps: dict, rounds: int, calls: int, enqueued: dict | None = None,
                  cycles: dict | None = None) -> list[tuple[int, str, float]]:
    """(round, variant, ms a call on this rank): every variant once a round, rotated, after a
    barrier.  enqueued: gets, per variant, the host's ms a call until the sample's last call was
    queued (before its synchronize): near the sample's time, the loop is host-bound.  cycles:
    gets, per variant and sample, the device's ms between the compute stream's arrivals at
    consecutive calls (events; the last to the sample's end) and the host's ms per call."""

    rows = []
    for r in range(rounds):
        names = list(steps)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            _switch(name)
            dist.barrier()
            torch.cuda.synchronize()
            ahead, done = VARIANTS[name][2], []
            with contextlib.ExitStack() as stack:
                if name in PROFILED:
                    stack.enter_context(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]))
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                marks, host_marks = [], [t0]
                for _ in range(calls):
                    if cycles is not None:
                        marks.append(torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True)))
                    steps[name]()
                    host_marks.append(time.perf_counter())
                    if ahead:  # the host waits for the call `ahead` calls back before queueing more
                        done.append(torch.cuda.current_stream().record_event())
                        if len(done) > ahead:
                            done.pop(0).synchronize()
                t_host = time.perf_counter()
                if cycles is not None:
                    marks.append(torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True)))
                torch.cuda.synchronize()
                rows.append((r, name, (time.perf_counter() - t0) / calls * 1e3))
                if cycles is not None:
                    cycles.setdefault(name, []).append({
                        "device_ms": [round(a.elapsed_time(b), 3) for a, b in zip(marks, marks[1:])],
                        "host_ms": [round((b - a) * 1e3, 3) for a, b in zip(host_marks, host_marks[1:])]})
            if enqueued is not None:
                enqueued.setdefault(name, []).append((t_host - t0) / calls * 1e3)
    return rows


def worker(rank: int, world: int, args) -> dict:
    import torch_commopt  # noqa: F401
    from torch_commopt.attention import ce_a2a, schedules
    from torch_commopt.tuner.autotune import ratio_summary

    torch.cuda.set_device(rank)
    group = dist.group.WORLD
    res = {}
    for seq in (int(s) for s in args.seq.split(",")):
        for heads in args.heads.split(","):
            h, h_kv = (int(x) for x in heads.split("/"))
            gen = torch.Generator(device="cuda").manual_seed(7 + rank)

            def mk(hh):
                return torch.randn(1, hh, seq // world, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
            q, k, v, dout = mk(h), mk(h_kv), mk(h_kv), mk(h)
            kw = dict(schedule="ulysses", causal=True, group=group)

            def step_of(groups: int):
                def step():
                    _, kept = schedules.cp_attention_fwd_keep(q, k, v, head_groups=groups, **kw)
                    return schedules.cp_attention_bwd_kept(dout, kept, **kw)
                return step
            steps = {name: step_of(g) for name, (g, *_) in VARIANTS.items()
                     if name == REFERENCE or not args.variants or name in args.variants}
            for name, step in steps.items():  # warm-up: every variant's buffers, plans and streams
                _switch(name)
                for _ in range(3):
                    step()
            torch.cuda.synchronize()
            host: dict[str, list[float]] = {}
            cycles: dict = {}
            rows = _timed_rounds(steps, args.rounds, args.calls, host, cycles)
            os.environ.pop(ce_a2a.GROUP_STREAMS_ENV, None)
            # the slowest rank's figures: medians per variant and per-round ratios to the reference
            mine = {name: statistics.median(ms for _, n, ms in rows if n == name) for name in steps}
            ratios = {name: ratio_summary(rows, name, REFERENCE) for name in steps if name != REFERENCE}
            flat = [mine[n] for n in steps] + [ratios[n][key] for n in ratios for key in ("median", "lo", "hi")]
            flat += [statistics.median(host[n]) for n in steps]
            t = torch.tensor(flat, dtype=torch.float64, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            vals = t.tolist()
            names = list(steps)
            res[f"S{seq} H{heads}"] = {
                "ms": {n: round(vals[i], 4) for i, n in enumerate(names)},
                "ratio_to_" + REFERENCE.replace(" ", "_"): {n: {key: round(vals[len(names) + 3 * j + i], 4)
                                                              for i, key in enumerate(("median", "lo", "hi"))}
                                                          for j, n in enumerate(ratios)},
                "host_enqueue_ms": {n: round(vals[len(names) + 3 * len(ratios) + i], 4) for i, n in enumerate(names)},
                "rounds_rank0": [(r, n, round(ms, 4)) for r, n, ms in rows] if rank == 0 else None,
                "cycles_rank0": cycles if rank == 0 else None}
            steps.clear()
            torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--seq", default="16384")
    ap.add_argument("--heads", default="32/32,32/8")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--variants", type=lambda t: [v for v in t.split(",") if v], default=None,
                    help=f"a subset of {list(VARIANTS)} (default all)")
    ap.add_argument("--tag", default="", help="suffix of the result file's name")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run_distributed(worker, 2, args, backend="nccl", timeout_s=500)[0]
    for case, r in res.items():
        ratio = r["ratio_to_" + REFERENCE.replace(" ", "_")]
        print(case, " ".join(f"{n} {ms:.3f}" for n, ms in r["ms"].items()), "| vs", REFERENCE,
              " ".join(f"{n} {x['median']:.4f} [{x['lo']:.4f}, {x['hi']:.4f}]" for n, x in ratio.items()),
              "| host enqueue", " ".join(f"{n} {ms:.3f}" for n, ms in r["host_enqueue_ms"].items()))
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": args.commit,
              "command": " ".join(["python3", *sys.argv]), "rounds": args.rounds, "calls": args.calls,
              "note": "slowest rank's medians (ms a fwd+bwd call), per-round ratios to the reference and the "
                      "host's enqueue ms a call (max over ranks of each figure)", "records": res}
    (out / f"probe_group_streams{'_' + args.tag if args.tag else ''}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
