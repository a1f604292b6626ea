"""Command line: `python -m torch_commopt demo [--world N] [--schedule S] [--chunks C]` and
`python -m torch_commopt calibrate [--world N] [--backend B] [--cache-dir D]` and
`python -m torch_commopt explain (--shape KIND:ROWSxKxN | --attention B,H,HKV,S,D[:causal][:train]) ...
[--world N] [--device NAME]` and
`python -m torch_commopt tune (--shape KIND:ROWSxKxN ... --attention B,H,HKV,S,D[:causal][:train] ... |
--model demo) [--world N] [--cache-dir D]`."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_commopt")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="TP+SP Llama block compiled with commopt, with a numerics check")
    demo.add_argument("--world", type=int, default=2)
    demo.add_argument("--schedule", default="auto", help="auto, sequential, chunked, ce_push, ce_pull, direct, fused or a full schedule string")
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    if args.command == "demo":
        from torch_commopt.demo import run_demo

        return run_demo(args.world, {"schedule": args.schedule, "chunks": args.chunks}, args.backend)
    if args.command == "explain":
        if not (args.shape or args.attention):
            parser.error("explain: give --shape and/or --attention (one or more)")
        if args.shape:
            from torch_commopt.tuner.choose import explain_shapes

            print(explain_shapes(args.shape, args.world, args.device, args.dtype, args.cache_dir))
        if args.attention:
            from torch_commopt.attention.tune import explain

            print(explain(args.attention, args.world, args.device, args.dtype, args.cache_dir))
        return 0
    if args.command == "tune":
        if bool(args.shape or args.attention) == bool(args.model):
            parser.error("tune: give --shape / --attention (one or more) or --model, not both")
        if args.model:
            from torch_commopt.demo import run_demo

            return run_demo(args.world, {"mode": "autotune", "cache_dir": args.cache_dir,
                                         "autotune_top_k": args.top_k, "cuda_graphs": args.cuda_graphs}, args.backend)
        from torch_commopt.tuner.tune import run_tune

        print(run_tune(args.shape, args.world, args.backend, args.dtype, args.cache_dir, args.top_k, args.cuda_graphs,
                       args.attention))
        return 0
    if args.command == "calibrate":
        from torch_commopt.tuner.calibrate import run_calibration

        print(run_calibration(args.world, args.backend, args.cache_dir))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
