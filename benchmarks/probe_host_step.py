"""Where a training step's host time goes, by sampling (py-spy), per variant and thread.

bench_e2e's host enqueue says how long the host takes to queue a step (commopt 36-39 ms against
inductor's 22-24 at batch 4 x 2048, s53), and its cProfile (--host-profile) says where, but
cProfile inflates Python-heavy code (commopt's) against C++-heavy code, and it does not see the
autograd engine's device thread, which runs the compiled backward.  This probe trains bench_e2e's
model for each variant and, after its warm-up, attaches py-spy to its own process (rank 0) for
`--steps` steps back to back: every thread, Python and native frames, a low overhead.  It
writes the raw samples (OUT/spy_<variant>.txt) and a summary (OUT/host_step.json / .md): per
thread, host ms a step by where the time is (our ops, their driver calls and GEMM launches,
NCCL collectives, the rest) and the frames with the most samples.

    python3 benchmarks/probe_host_step.py OUT --batch 4 --seq 2048 --variants inductor,commopt \\
        --py-spy /tmp/spy/bin/py-spy [--steps 60] [--rate 1000]
    python3 benchmarks/probe_host_step.py OUT --analyze   # the summary again from OUT's raw files
    python3 benchmarks/probe_host_step.py OUT --timing --isolated --steps 20   # no py-spy: each op
        # call's wall and CPU time per thread (TORCH_COMMOPT_HOST_TIMING=1), steps on an empty queue

Read the py-spy figures as shares: with --native each sample stops the process for ~8 ms (2x
H200, session 54), so the samples spread over the process's own running time, not wall time.

py-spy is not a dependency: carry its wheel (`pip download py-spy`) and install it with
`pip install --target`.  Attaching needs ptrace on the own process (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# Where a sample is, by the first of these (a frame's text) found in its stack, innermost first
# for the leaf categories.  Checked in order: the first rule that matches wins.
REGION_FRAMES = ("kernels/ops.py", "kernels/gpu/")  # inside a commopt op (its Python, launches)
NCCL_FRAMES = ("_functional_collectives", "ProcessGroupNCCL", "c10d")
LEAVES = [("driver call (ctypes)", ("libcuda.so", "_ctypes", "libffi")),
          ("cuBLAS", ("libcublas",)),
          ("kernel launch (runtime)", ("libcudart", "cudaLaunch", "cuLaunch")),
          ("allocator", ("CUDACachingAllocator", "DeviceCachingAllocator", "NativeCachingAllocator")),
          ("waiting (futex, condition, sleep)", ("pthread_cond", "futex", "nanosleep", "sem_wait", "lll_lock",
                                                 "epoll", "poll (")),
          ("dispatcher / ATen", ("libtorch_cpu", "libc10.so", "libtorch_cuda", "libtorch_python")),
          ("python", ("",))]


def _frames(stack: str) -> list[str]:
    return stack.split(";")


def summarize(raw: pathlib.Path, rate: int, steps: int, top: int = 25) -> dict:
    """Per thread: samples -> ms a step, split by area (commopt op / NCCL / other) and by leaf
    kind; the frames (inclusive) and leaves with the most samples."""
    per_thread: dict = collections.defaultdict(lambda: {"samples": 0, "area": collections.Counter(),
                                                        "leaf": collections.Counter(),
                                                        "region_leaf": collections.Counter(),
                                                        "inclusive": collections.Counter(),
                                                        "self": collections.Counter()})
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = _frames(stack)
        thread = re.sub(r"\(\d+\)", "", frames[0]).strip() if frames[0].startswith("thread") else "?"
        if "MainThread" in thread and not any(f.startswith("_window ") for f in frames):
            continue  # the main thread outside the steps (the attach wait, the synchronize after)
        rec = per_thread[thread]
        rec["samples"] += n
        area = ("commopt op" if any(k in f for f in frames for k in REGION_FRAMES) else
                "NCCL collective" if any(k in f for f in frames for k in NCCL_FRAMES) else "other")
        rec["area"][area] += n
        leaf = frames[-1]
        kind = next(name for name, keys in LEAVES if any(k in leaf for k in keys))
        rec["leaf"][kind] += n
        if area == "commopt op":
            rec["region_leaf"][kind] += n
        rec["self"][leaf] += n
        for f in set(frames[1:]):
            rec["inclusive"][f] += n
    ms = lambda n: round(n / rate / steps * 1e3, 3)  # noqa: E731  (samples -> ms a step)
    out = {}
    for thread, rec in sorted(per_thread.items(), key=lambda kv: -kv[1]["samples"]):
        out[thread] = {"ms_per_step": ms(rec["samples"]),
                       "by_area_ms": {k: ms(v) for k, v in rec["area"].most_common()},
                       "by_leaf_ms": {k: ms(v) for k, v in rec["leaf"].most_common()},
                       "commopt_op_by_leaf_ms": {k: ms(v) for k, v in rec["region_leaf"].most_common()},
                       "top_inclusive_ms": [(f, ms(v)) for f, v in rec["inclusive"].most_common(top)],
                       "top_self_ms": [(f, ms(v)) for f, v in rec["self"].most_common(top)]}
    return out


def worker(rank: int, world: int, shape: dict, variants: list[str], warm: int, steps: int, out: str,
           spy: str | None, rate: int, native: bool, isolated: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    import bench_e2e
    from torch_commopt.kernels import ops

    torch.cuda.set_device(rank)
    x, target = bench_e2e.inputs(shape, world, rank, "cuda")
    torch._dynamo.reset()
    bench_e2e.allow_entries(len(variants) * shape["layers"])
    result = {}
    for variant in variants:
        bench_e2e._async_tp(variant == "inductor+async-TP")
        step = bench_e2e._train_step(bench_e2e.build(variant, shape, "cuda"), x, target, fused=True)
        for _ in range(warm):
            step()
        torch.cuda.synchronize()
        raw = _raw_path(pathlib.Path(out), variant, rank)
        proc = None
        ops.HOST_TIMES.clear()
        if rank == 0 and spy:  # py-spy on this process, every thread; stopped by SIGINT after the steps
            cmd = [spy, "record", "--pid", str(os.getpid()), "--threads", "-r", str(rate), "-f", "raw",
                   "-o", str(raw), "-d", "600"] + (["--native"] if native else [])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            time.sleep(2.0)  # attached before the steps start
        dist.barrier()
        torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        if isolated:  # each step on an empty queue: no launch waits for the GPU to free a slot
            enqueue = 0.0
            for _ in range(steps):
                torch.cuda.synchronize()
                enqueue += _window(step, 1)
        else:
            enqueue = _window(step, steps)
        cpu = (time.thread_time() - c0) * 1e3
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
        rec = {"step_ms": total / steps, "enqueue_ms": enqueue / steps, "main_thread_cpu_ms": cpu / steps,
               "cpus_allowed": len(os.sched_getaffinity(0)), "threads": threading.active_count(),
               # per (op, thread): calls a step, wall and thread-CPU us a call (TORCH_COMMOPT_HOST_TIMING=1)
               "op_host": {f"{op} @ {thread}": {"calls_per_step": n / steps, "wall_us": round(w / n * 1e6, 1),
                                                "cpu_us": round(c / n * 1e6, 1)}
                           for (op, thread), (n, w, c) in ops.HOST_TIMES.items()}}
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            rec["py_spy"] = proc.communicate(timeout=120)[0].decode(errors="replace")[-400:]
            rec["raw"] = str(raw) if raw.exists() else None
        bench_e2e._async_tp(False)
        result[variant] = rec
        dist.barrier()
    return result


def _raw_path(out: pathlib.Path, variant: str, rank: int) -> pathlib.Path:
    """Where py-spy writes a variant's raw samples."""
    return out / f"spy_{variant.replace(' ', '_').replace('+', '_')}_rank{rank}.txt"


def _window(step, steps: int) -> float:
    """`steps` training steps back to back: the sampled window (ms until the last returned)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) * 1e3


def report(out: pathlib.Path, meta: dict, timings: dict, rate: int, steps: int) -> None:
    summary = {}
    for variant in meta["variants"]:
        raw = _raw_path(out, variant, 0)
        if raw.exists():
            summary[variant] = summarize(raw, rate, steps)
    (out / "host_step.json").write_text(json.dumps({"meta": meta, "timings": timings, "summary": summary}, indent=1))
    lines = [f"# Host time of a training step, sampled (py-spy {rate} Hz, rank 0, {steps} steps back to back)", "",
             f"shape {meta['shape']}, commit {meta.get('commit')}", ""]
    for variant, threads in summary.items():
        t = timings.get(variant, {})
        lines.append(f"## {variant}: step {t.get('step_ms', 0):.2f} ms, host enqueue {t.get('enqueue_ms', 0):.2f} ms a step")
        for thread, rec in threads.items():
            if rec["ms_per_step"] < 0.5:
                continue
            lines += ["", f"### {thread}: {rec['ms_per_step']} ms a step on the CPU",
                      f"- by area: {rec['by_area_ms']}", f"- by leaf: {rec['by_leaf_ms']}",
                      f"- commopt ops by leaf: {rec['commopt_op_by_leaf_ms']}", "- top inclusive frames (ms a step):"]
            lines += [f"  - {ms:7.3f}  {f[:160]}" for f, ms in rec["top_inclusive_ms"]]
            lines.append("- top leaves (ms a step):")
            lines += [f"  - {ms:7.3f}  {f[:160]}" for f, ms in rec["top_self_ms"][:15]]
        lines.append("")
    (out / "host_step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default="inductor,commopt")
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--no-native", action="store_true")
    ap.add_argument("--isolated", action="store_true",
                    help="the steps one at a time, synchronized before each (a long burst fills the launch queue, "
                         "and then every launch waits for the GPU: its host time is not the host's cost)")
    ap.add_argument("--timing", action="store_true",
                    help="no py-spy: each op call's host time (TORCH_COMMOPT_HOST_TIMING=1), per thread")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--analyze", action="store_true", help="summarize OUT's raw files again (OUT/host_step.json's meta)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.analyze:
        saved = json.loads((out / "host_step.json").read_text())
        report(out, saved["meta"], saved["timings"], saved["meta"]["rate"], saved["meta"]["steps"])
        return
    from torch_commopt.launch import run_distributed

    shape = {"layers": args.layers, "batch": args.batch, "seq": args.seq, "dim": 4096, "heads": 32, "kv_heads": 8,
             "hidden": 14336}
    variants = args.variants.split(",")
    if args.timing:  # the spawned ranks read it when they import torch_commopt
        from torch_commopt.kernels.ops import HOST_TIMING_ENV

        os.environ[HOST_TIMING_ENV] = "1"
    per_rank = run_distributed(worker, 2, shape, variants, args.warm, args.steps, str(out),
                               None if args.timing else args.py_spy, args.rate, not args.no_native, args.isolated,
                               backend="nccl", timeout_s=900)
    if args.timing:
        (out / "host_timing.json").write_text(json.dumps({"shape": shape, "commit": args.commit, "ranks": per_rank},
                                                         indent=1))
        for r, res in enumerate(per_rank):
            for variant, rec in res.items():
                print(f"rank {r} {variant}: step {rec['step_ms']:.2f} ms, enqueue {rec['enqueue_ms']:.2f} ms, "
                      f"main thread CPU {rec['main_thread_cpu_ms']:.2f} ms a step, {rec['cpus_allowed']} CPUs allowed, "
                      f"{rec['threads']} Python threads")
                for key, v in rec["op_host"].items():
                    print(f"    {key}: {v}")
        return
    meta = {"shape": shape, "variants": variants, "rate": args.rate, "steps": args.steps, "commit": args.commit}
    report(out, meta, per_rank[0], args.rate, args.steps)


if __name__ == "__main__":
    main()
