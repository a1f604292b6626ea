"""Every call checked: context-parallel attention (fwd+bwd, the autograd wrapper the compiled path
uses) called over and over, cases and schedules rotated as bench_attention's rounds rotate them,
each call's out, dq, dk, dv compared with the single-GPU full attention, and the copy-engine
all-to-all's flags checked at rest between calls.

Why: session 20's bench_attention run (2x H100) saw `ulysses:g=1` at B1 H32/32 S32768 causal
0.6 off (out, dq, dk, dv alike) at its first call, after the S16384 cases' rounds; the same
schedule and shape alone (a second bench run, benchmarks/probe_a2a_large.py) were exact.  A
result that is wrong once in many calls is what this looks for: the failures are listed with
their round, case, schedule and call, and where the flags were not at rest.

Session 21: the wrong call is bench_attention's first call on a buffer grown while the GPU still
ran the case's single-GPU reference; this script's checks left the GPU idle before every call,
and it never failed.  --busy-ms (default 50) now queues GPU work before the first call of each
case and schedule, so its buffers grow on a busy GPU too.

    torchrun --nproc-per-node 2 benchmarks/stress_cp_attention.py OUTDIR [--rounds 4] [--calls 3] [--busy-ms 50]
        [--seq 16384,32768] [--heads 32/32,32/8] [--schedules ulysses:g=1,ulysses:g=2,ring_zigzag,ulysses]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_attention import (TOLERANCE, Case, _errors, _full_inputs, _global_errors, _grads, _leaves,  # noqa: E402
                             shard, single_gpu)


def _runtime(group):
    """`group`'s symmetric-memory runtime on this rank's GPU (None before its first GPU call)."""
    from torch_commopt.kernels.gpu import symm

    return symm.existing(group.group_name, torch.device("cuda", torch.cuda.current_device()))


def _flags_at_rest(group) -> dict:
    """The copy-engine all-to-all's flags on this rank, checked once every rank has finished
    (synchronize + barrier): every token back (1), every data flag down (0).  A second barrier
    after the read: without it a peer that left the first barrier sooner may already have
    raised a flag for its next call (session 21's first "flags not at rest" were that race)."""
    from torch_commopt.kernels.gpu import symm

    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    rt = _runtime(group)
    if rt is None:
        dist.barrier()
        return {}
    span = 2 * symm.HALVES * symm.MAX_WORLD
    free = rt.flags[symm.A2A_FREE: symm.A2A_FREE + span].view(2, symm.HALVES, symm.MAX_WORLD)[..., :rt.world].cpu()
    data = rt.flags[symm.A2A_DATA: symm.A2A_DATA + span].view(2, symm.HALVES, symm.MAX_WORLD)[..., :rt.world].cpu()
    dist.barrier()
    bad = {}
    if bool((free != 1).any()):
        bad["free"] = free.tolist()
    if bool((data != 0).any()):
        bad["data"] = data.tolist()
    return bad


def _can_flush_remote_writes(ordinal: int) -> int | None:
    """CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES (98): whether cuStreamWaitValue32 may take
    CU_STREAM_WAIT_VALUE_FLUSH, which makes remote writes that arrived before the flag visible
    to the work after the wait (our waits do not ask for it; one hypothesis for a wrong call)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) or lib.cuDeviceGetAttribute(ctypes.byref(value), 98, dev):
            return None
        return value.value
    except OSError:
        return None


def _buffers(group) -> list[tuple[int, int]]:
    """The all-to-all buffers of `group`'s runtime, oldest first."""
    from torch_commopt.attention.ce_a2a import PURPOSE

    rt = _runtime(group)
    if rt is None:
        return []
    # (MiB, the handle's own address minus the tensor's: 0 unless torch maps it elsewhere)
    return [(b.nbytes >> 20, int(b.handle.buffer_ptrs[rt.rank]) - b.local.data_ptr()) for b in rt.owned.get(PURPOSE, [])]


def _rolled(case, local: dict, ref: dict) -> tuple[dict, dict]:
    """The case's inputs with their heads rotated (queries and dout by H / H_kv, K/V by one, so
    every query head keeps its K/V head) and the truth rotated the same way: a second input set
    whose truth needs no second single-GPU run."""
    rq = case.heads // case.kv_heads
    by = {"q": rq, "dout": rq, "out": rq, "dq": rq, "k": 1, "v": 1, "dk": 1, "dv": 1}
    return ({n: t.roll(by[n], dims=1) for n, t in local.items()},
            {n: t.roll(by[n], dims=1) for n, t in ref.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--seq", default="16384,32768")
    parser.add_argument("--heads", default="32/32,32/8")
    parser.add_argument("--schedules", default="ulysses:g=1,ulysses:g=2,ring_zigzag,ulysses")
    parser.add_argument("--fresh-group", type=int, default=1, help="a new process group every round after the first")
    parser.add_argument("--rotate", type=int, default=0, help="rotate the case order by round (default: the bench's order)")
    parser.add_argument("--alternate", type=int, default=1,
                        help="every other call takes the inputs with their heads rotated (a call that reads the previous "
                             "call's data, e.g. through a stale flag, then gives a wrong result instead of a right one)")
    parser.add_argument("--check-forward", type=int, default=1, help="check the flags at rest after the forward too")
    parser.add_argument("--empty-cache", type=int, default=1, help="torch.cuda.empty_cache() after each case, as "
                        "bench_attention does")
    parser.add_argument("--busy-ms", type=float, default=50.0,
                        help="queue this much GPU work (a spin) before the first call of each case and schedule, so "
                             "a buffer grows while the GPU is busy, as in bench_attention (session 21's wrong call)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()  # without: a gloo smoke run of this script (float32, no flags)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank)
    dtype, dev = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    cases = [Case(1, int(h.split("/")[0]), int(h.split("/")[1]), 128, int(s), True, "fwd+bwd")
             for s in args.seq.split(",") for h in args.heads.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    tol = TOLERANCE[dtype]
    prepared = []
    for case in cases:  # inputs and the truth once per case (the bench's first-call check)
        full = _full_inputs(case, dtype, dev)
        with single_gpu(case, full) as (step, outputs):
            step()
            ref = {k: v.detach().clone() for k, v in outputs().items()}
        local = {n: shard(t, rank, world, "contiguous") for n, t in full.items()}
        # the head-rotated second input set and its truth, once per case (args.alternate)
        prepared.append((case, (local, ref), _rolled(case, local, ref) if args.alternate else None))
        del full
    failures, calls, start = [], 0, time.perf_counter()
    from torch_commopt.attention import cp_attention

    for rnd in range(args.rounds):
        # a new group per round: a fresh runtime whose all-to-all buffer grows from the first case's
        # size class to the larger ones during the round (the failing call of session 20 was the
        # one that grew it, 512 -> 1024 MiB)
        group = dist.new_group(list(range(world))) if args.fresh_group and rnd else dist.group.WORLD
        for i in range(len(prepared)):
            case, plain, rotated = prepared[(i + rnd) % len(prepared)] if args.rotate else prepared[i]
            for j in range(len(schedules)):
                s = schedules[(j + rnd) % len(schedules)]
                for c in range(args.calls):
                    rolled = bool(args.alternate and calls % 2)
                    x, want = rotated if rolled else plain
                    leaves = _leaves(x["q"], x["k"], x["v"])
                    if cuda and args.busy_ms and c == 0:
                        torch.cuda._sleep(int(args.busy_ms * 1.5e6))  # ~1.5 GHz: cycles per ms, roughly
                    out = cp_attention(*leaves, schedule=s, causal=case.causal, group=group)
                    fwd = _global_errors(_errors({"out": out.detach()}, want, rank, world, "contiguous"), dev)
                    flags_fwd = _flags_at_rest(group) if cuda and args.check_forward else {}
                    out.backward(x["dout"])
                    errors = _global_errors(_errors({"out": out.detach(), **_grads(leaves)}, want, rank, world,
                                                    "contiguous"), dev)
                    flags = _flags_at_rest(group) if cuda else {}
                    calls += 1
                    if max(errors.values()) > tol or fwd["out"] > tol or flags or flags_fwd:
                        failures.append({"round": rnd, "case": case.label(), "schedule": s, "call": c, "rolled": rolled,
                                         "out_after_forward": fwd["out"], "errors": errors,
                                         "flags_not_at_rest_after_forward": flags_fwd,
                                         "flags_not_at_rest": flags, "buffers_mib": _buffers(group) if cuda else None})
                        print(json.dumps({"rank": rank, **failures[-1]}), flush=True)
            if cuda and args.empty_cache:  # as bench_attention does after each case
                torch.cuda.empty_cache()
    summary = {"rank": rank, "world": world, "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
               "can_flush_remote_writes": _can_flush_remote_writes(rank) if cuda else None,
               "calls": calls, "failures": len(failures), "alternate": args.alternate, "busy_ms": args.busy_ms,
               "empty_cache": args.empty_cache, "debug_waits": os.environ.get("TORCH_COMMOPT_DEBUG_WAITS", "0"),
               "seconds": round(time.perf_counter() - start, 1),
               "cases": [c.label() for c, _, _ in prepared], "schedules": schedules, "records": failures}
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}), flush=True)
    write_summary(args.out, "stress_cp_attention", rank, summary)
    dist.destroy_process_group()


def write_summary(out_dir: str, stem: str, rank: int, summary: dict) -> None:
    """OUT_DIR/<stem>_rank<rank>.json (the directory made if missing)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}_rank{rank}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
