"""Whether a fresh process group's first calls leave a copy-engine all-to-all flag up.

Session 21's first stress runs (2x H100, benchmarks/stress_cp_attention.py) reported a data
flag of the Ulysses all-to-all (attention/ce_a2a.py) still 1 after the first call of a fresh
process group (rank 1, source 0).  A flag up at rest would let the next call's wait pass
before its data landed.  This probe repeated that first call on many fresh groups, each
prepared differently before it, and counted the flags left up -- and showed the report to be
the check's own race: a rank read its flags after synchronize + barrier while the faster peer
had already left the barrier and raised the flag of its next call (the ping-pong saw it at every
time but the last).  With a second barrier after the read (here and in the stress script), 240
ping-pongs and 30 first attention calls rest (results/a2a_growth_h100x2_2026-11-25_s21.md).

  none     the first call straight away (as the stress runs)
  nccl     one NCCL all-reduce on the new group first (its communicator set up before the call)
  runtime  the group's symmetric runtime (flags, streams) created first, then the call
  both     nccl, then runtime
  pp_reset no attention: right after the runtime is created, each rank raises the peer's data
           flag from its side stream and the peer lowers it after a wait (the protocol alone)
  pp_touch pp_reset after one remote write into the peer's flag (its mapping touched first)
  pp_epoch the flag raised to 1, 2, 3... by the writer and never lowered (one writer a word)

    torchrun --nproc-per-node 2 benchmarks/probe_fresh_group_flags.py OUTDIR [--groups 32] [--calls 2]
        [--seq 8192] [--heads 16/16] [--schedule ulysses:g=1] [--preps none,nccl,runtime,both,pp_reset,pp_touch,pp_epoch]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_attention import TOLERANCE, Case, _errors, _full_inputs, _global_errors, _grads, _leaves, shard, single_gpu  # noqa: E402
from stress_cp_attention import _flags_at_rest, write_summary  # noqa: E402


def _prepare(prep: str, group, dev: torch.device) -> None:
    from torch_commopt.kernels.gpu import symm

    if prep in ("nccl", "both"):
        t = torch.ones(1, device=dev)
        dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
    if prep in ("runtime", "both") or prep.startswith("pp_"):
        symm.runtime(group.group_name, dev)
        torch.cuda.synchronize()
        dist.barrier()


def _pingpong(group, dev: torch.device, times: int, mode: str) -> list[dict]:
    """The data-flag protocol alone, `times` times: raise the peer's flag (side stream), wait for
    ours, log the value the wait saw (compute stream), then -- mode reset -- lower it after a
    compute's worth of delay, as ce_a2a does; mode touch: the same after one remote write of 0
    into the peer's flag at creation (a first touch of its mapping); mode epoch: no lowering,
    the writer raises the flag to 1, 2, 3... (each word written by one rank only).  Returns the
    times whose flag was not where it should be at rest, or whose wait saw less than its value."""
    from torch_commopt.kernels.gpu import driver, symm

    rt = symm.runtime(group.group_name, dev)
    compute = torch.cuda.current_stream(dev)
    seen = torch.zeros(times, rt.world, dtype=torch.int32, device=dev)
    if mode == "touch":
        for peer in rt.peers:
            driver.write_value32(rt.side, rt.flag_address(peer, symm.A2A_DATA + rt.rank), 0)
        torch.cuda.synchronize()
        dist.barrier()
    bad = []
    for i in range(times):  # the check at rest between times orders a raise after the last lowering
        value = i + 1 if mode == "epoch" else 1
        for peer in rt.peers:
            rt.signal(rt.side, peer, symm.A2A_DATA + rt.rank, value)
        for src in rt.sources:
            index = symm.A2A_DATA + src  # region IN, half 0
            rt.wait(compute, index, value, debug=False, what="all-to-all piece", src=src, chunk=i)
            seen[i, src].copy_(rt.flags[index])
            torch.cuda._sleep(20_000)  # a compute's worth of delay before the flag is lowered
            if mode != "epoch":
                driver.write_value32(compute, rt.flag_address(rt.rank, index), 0)
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        rest = 0 if mode != "epoch" else value
        now = {src: int(rt.flags[symm.A2A_DATA + src]) for src in rt.sources}
        dist.barrier()  # no rank raises the next time's flag before every rank has read its own
        saw = {src: int(seen[i, src]) for src in rt.sources}
        if any(v != rest for v in now.values()) or any(v < value for v in saw.values()):
            bad.append({"time": i, "at_rest": now, "wait_saw": saw, "expected": value})
    return bad


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", default="16/16")
    parser.add_argument("--schedule", default="ulysses:g=1")
    parser.add_argument("--preps", default="none,nccl,runtime,both,pp_reset,pp_touch,pp_epoch")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    h, hk = (int(x) for x in args.heads.split("/"))
    case = Case(1, h, hk, 128, args.seq, True, "fwd+bwd")
    full = _full_inputs(case, torch.bfloat16, "cuda")
    with single_gpu(case, full) as (step, outputs):
        step()
        ref = {k: v.detach().clone() for k, v in outputs().items()}
    local = {n: shard(t, rank, world, "contiguous") for n, t in full.items()}
    del full
    preps = args.preps.split(",")
    from torch_commopt.attention import cp_attention

    records, counts, start = [], collections.Counter(), time.perf_counter()
    for i in range(args.groups):
        prep = preps[i % len(preps)]
        group = dist.new_group(list(range(world)))
        _prepare(prep, group, dev)
        counts[prep, "groups"] += 1
        if prep.startswith("pp_"):
            for bad in _pingpong(group, dev, args.calls, prep[3:]):
                counts[prep, "flags up"] += 1
                records.append({"group": i, "prep": prep, **bad})
            continue
        for c in range(args.calls):
            leaves = _leaves(local["q"], local["k"], local["v"])
            out = cp_attention(*leaves, schedule=args.schedule, causal=True, group=group)
            flags_fwd = _flags_at_rest(group)
            out.backward(local["dout"])
            flags = _flags_at_rest(group)
            errors = _global_errors(_errors({"out": out.detach(), **_grads(leaves)}, ref, rank, world, "contiguous"),
                                    "cuda")
            wrong = max(errors.values()) > TOLERANCE[torch.bfloat16]
            for what, up in (("after forward", flags_fwd), ("after backward", flags)):
                if up:
                    counts[prep, f"flags up {what}, call {c}"] += 1
                    records.append({"group": i, "prep": prep, "call": c, "when": what, "flags": up})
            if wrong:
                counts[prep, "wrong"] += 1
                records.append({"group": i, "prep": prep, "call": c, "errors": errors})
    summary = {"rank": rank, "world": world, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "case": case.label(), "schedule": args.schedule, "seconds": round(time.perf_counter() - start, 1),
               "counts": {f"{p}: {what}": n for (p, what), n in sorted(counts.items())}, "records": records}
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}), flush=True)
    for r in records:
        print(json.dumps({"rank": rank, **r}), flush=True)
    write_summary(args.out, "probe_fresh_group_flags", rank, summary)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
