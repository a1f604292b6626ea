"""The command line (`python -m torch_commopt`, `torch-commopt`):
`python -m torch_commopt demo [--world N] [--schedule S] [--chunks C]` and
`python -m torch_commopt calibrate [--world N] [--backend B] [--cache-dir D]` and
`python -m torch_commopt explain (--shape KIND:ROWSxKxN | --attention B,H,HKV,S,D[:causal][:train]) ...
[--world N] [--device NAME]` and
`python -m torch_commopt tune (--shape KIND:ROWSxKxN ... --attention B,H,HKV,S,D[:causal][:train] ... |
--model demo) [--world N] [--cache-dir D]` and
`python -m torch_commopt timeline TRACE [TRACE ...] [--label NAME ...] [--out DIR]`."""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.distributed as dist

from torch_commopt.testing.launch import run_distributed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_commopt")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="TP+SP Llama block compiled with commopt, with a numerics check")
    demo.add_argument("--world", type=int, default=2)
    demo.add_argument("--schedule", default="auto",
                      help="auto, sequential, chunked, ce_push, ce_pull, direct, fused or a full schedule string")
    demo.add_argument("--chunks", type=int, default=4)
    demo.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    demo.add_argument("-v", "--verbose", action="store_true", help="log commopt's decisions")
    cal = sub.add_parser("calibrate", help="measure this machine for the cost model and store it in the tuner cache")
    cal.add_argument("--world", type=int, default=2)
    cal.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    cal.add_argument("--cache-dir", default=None)
    exp = sub.add_parser("explain", help="the cost model's ranking of the candidates for region shapes")
    exp.add_argument("--shape", action="append", default=[],
                     help="KIND:ROWSxKxN[,N2...] (rows and K of the local A), e.g. matmul_rs:8192x4096x8192")
    exp.add_argument("--attention", action="append", default=[],
                     help="B,H,HKV,S,D[:causal][:train]: a context-parallel attention's global q/k/v shape")
    exp.add_argument("--world", type=int, default=2)
    exp.add_argument("--device", default="cpu", help='"cpu" or a CUDA device name, e.g. "NVIDIA H200"')
    exp.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 otherwise")
    exp.add_argument("--cache-dir", default=None)
    tune = sub.add_parser("tune", help="time the candidates of region shapes (or a model) now and fill the tuner cache")
    tune.add_argument("--shape", action="append", default=[], help="KIND:ROWSxKxN[,N2...] as for explain")
    tune.add_argument("--attention", action="append", default=[],
                      help="B,H,HKV,S,D[:causal][:train]: a context-parallel attention's global q/k/v shape, "
                           "timed forward (or forward + backward with :train)")
    tune.add_argument("--model", choices=["demo"], help="run this model once with mode='autotune' instead")
    tune.add_argument("--world", type=int, default=2)
    tune.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    tune.add_argument("--dtype", default=None, help="default: bfloat16 on GPUs, float32 on CPUs")
    tune.add_argument("--top-k", type=int, default=4)
    tune.add_argument("--cache-dir", default=None)
    tune.add_argument("--cuda-graphs", action="store_true",
                      help="tune for a program replayed from CUDA graphs (Config.cuda_graphs): time graph replays")
    line = sub.add_parser("timeline", help="a picture of where a profiled step's time goes (PNG and HTML)")
    line.add_argument("traces", nargs="+", help="torch.profiler Chrome traces (export_chrome_trace), drawn one "
                                                "above the other, e.g. commopt's and the baseline's")
    line.add_argument("--label", action="append", default=[], help="a name per trace (default: the file's)")
    line.add_argument("--out", default=".", help="directory for timeline.png and timeline.html")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    if args.command == "demo":
        from torch_commopt.testing.demo import run_demo

        return run_demo(args.world, {"schedule": args.schedule, "chunks": args.chunks}, args.backend)
    if args.command == "timeline":
        return _timeline(parser, args)
    if args.command == "explain":
        if not (args.shape or args.attention):
            parser.error("explain: give --shape and/or --attention (one or more)")
        if args.shape:
            from torch_commopt.tuner.matmul.choose import explain_shapes

            print(explain_shapes(args.shape, args.world, args.device, args.dtype, args.cache_dir))
        if args.attention:
            from torch_commopt.tuner.attention.tune import explain

            print(explain(args.attention, args.world, args.device, args.dtype, args.cache_dir))
        return 0
    if args.command == "tune":
        if bool(args.shape or args.attention) == bool(args.model):
            parser.error("tune: give --shape / --attention (one or more) or --model, not both")
        if args.model:
            from torch_commopt.testing.demo import run_demo

            return run_demo(args.world, {"mode": "autotune", "cache_dir": args.cache_dir,
                                         "autotune_top_k": args.top_k, "cuda_graphs": args.cuda_graphs}, args.backend)
        print(run_tune(args.shape, args.world, args.backend, args.dtype, args.cache_dir, args.top_k, args.cuda_graphs,
                       args.attention))
        return 0
    if args.command == "calibrate":
        print(run_calibration(args.world, args.backend, args.cache_dir))
        return 0
    return 2


def _calibrate_worker(rank: int, world: int, cache_dir: str | None) -> str:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    from torch_commopt.tuner.calibrate import calibrate_and_store

    return calibrate_and_store(dist.group.WORLD.group_name, device, cache_dir).to_json()


def run_calibration(world: int, backend: str = "auto", cache_dir: str | None = None, *,
                    values: dict | None = None) -> str:
    """Launch `world` local processes, calibrate, store; a summary of what was measured
    (`values`, if given, receives every calibrated figure: the stored JSON as a dict)."""
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    start = time.perf_counter()
    text = run_distributed(_calibrate_worker, world, cache_dir, backend=backend, timeout_s=600)[0]
    from torch_commopt.tuner.calibrate import AGREE
    from torch_commopt.tuner.calibration import Calibration

    cal = Calibration.from_json(text)
    if values is not None:
        values.update(json.loads(text))
    gemm = ", ".join(f"{d} {f.peak_flops / 1e12:.1f} TFLOP/s" for d, f in cal.gemm.items())
    links = ", ".join(f"{c} {link.bytes_per_s / 1e9:.1f} GB/s + {link.alpha_s * 1e6:.0f} us"
                      for c, link in cal.collective.items())
    return (f"commopt calibrate: {cal.device} x{cal.world} ({backend}) in {time.perf_counter() - start:.1f} s: "
            f"gemm {gemm}; {links}; host {cal.host('sequential') * 1e6:.0f} us per sequential call; "
            + (f"copy-engine push {cal.p2p.bytes_per_s / 1e9:.0f} GB/s, GEMM slowdown beside it "
               f"{cal.overlap_slowdown:.2f}, beside NCCL {cal.collective_slowdown:.2f}; " if cal.p2p else "") +
            (f"a third pass for {', '.join(cal.remeasured)} (two disagreed by > {AGREE:.0%}); " if cal.remeasured else "")
            + f"stored in {cache_dir or 'the default tuner cache'}")


def run_tune(specs: list[str], world: int, backend: str = "auto", dtype: str | None = None,
             cache_dir: str | None = None, top_k: int = 4, cuda_graphs: bool = False,
             attention: list[str] | None = None) -> str:
    """Time and cache the candidates of each shape on `world` local processes; a summary.
    cuda_graphs: for programs replayed from CUDA graphs (Config.cuda_graphs; matmul shapes
    only); attention: context-parallel attention shapes "B,H,HKV,S,D[:causal][:train]"."""
    from torch_commopt.tuner.attention.tune import parse_spec
    from torch_commopt.tuner.tune import parse_shape, tune_this_rank

    attention = list(attention or [])
    for spec in specs:
        parse_shape(spec)  # bad input fails here, before anything is spawned
    for spec in attention:
        shape, _, _ = parse_spec(spec)
        if shape.seq % world:
            raise ValueError(f"commopt tune: --attention {spec!r}: sequence {shape.seq} is not a multiple of "
                             f"--world {world}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    dtype = dtype or ("bfloat16" if backend == "nccl" else "float32")
    results = run_distributed(tune_this_rank, world, specs, dtype, cache_dir, top_k, cuda_graphs, tuple(attention),
                              backend=backend, timeout_s=1800)[0]
    lines = [f"commopt tune: {len(specs) + len(attention)} shape(s), {world} ranks ({backend}), {dtype}; "
             f"stored in {cache_dir or 'the default tuner cache'}"]
    for spec, best, measured in results:
        lines.append(f"{spec}: {best}  (" + ", ".join(f"{s} {t:.3f} ms" for s, t in sorted(measured.items(), key=lambda x: x[1]))
                     + ")")
    return "\n".join(lines)


def _timeline(parser, args) -> int:
    import pathlib

    from torch_commopt import timeline

    if args.label and len(args.label) != len(args.traces):
        parser.error(f"timeline: {len(args.label)} --label for {len(args.traces)} traces")
    labels = args.label or [pathlib.Path(t).stem for t in args.traces]
    steps = [timeline.load(t, label) for t, label in zip(args.traces, labels)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timeline.render(steps, out / "timeline.png", out / "timeline.html")
    for step in steps:
        print(step.label, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in step.summary().items()}))
    print(f"wrote {out / 'timeline.png'} and {out / 'timeline.html'}")
    return 0
