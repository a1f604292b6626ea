"""The main job: a small Llama-style block with DTensor TP+SP, compiled with commopt.

Spawns `world` processes (gloo on CPU; NCCL when at least `world` GPUs are present),
runs forward and backward eagerly (float64 reference, float32) and compiled with
`backend="commopt"`, prints what was found, the chosen schedules and the numerics,
and returns a non-zero exit code when an error is out of tolerance.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torch_commopt.config import Config
from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import TOLERANCE_FACTOR, check_shape


def _demo_rank(rank: int, world: int, options: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    import torch_commopt
    from torch_commopt.testing.validate import check

    torch_commopt.reset_explain()
    start = time.perf_counter()
    errors = check("tp_sp_block", options, shape=shape)
    return {
        "explain": str(torch_commopt.explain()),
        "errors": [(e.name, e.compiled, e.eager, e.ok()) for e in errors],
        "seconds": time.perf_counter() - start,
    }


def pick_backend(world: int) -> str:
    """NCCL when this machine has `world` GPUs, else gloo on CPU."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def run_demo(world: int = 2, options: dict[str, Any] | None = None, backend: str = "auto") -> int:
    options = dict(options or {})
    Config.from_options(options)  # reject bad options before spawning anything
    backend = pick_backend(world) if backend == "auto" else backend
    if backend == "nccl" and options.get("schedule", "auto") == "auto" and options.get("mode", "auto") == "auto":
        # The demo's block is far too small for the built-in rule to pick a GPU schedule
        # (it would choose NCCL sequential); on GPUs the demo shows the copy-engine kernels.
        options["schedule"] = "ce_push"
    # 8 features a head, every sharded size a multiple of the world (64 / 128 features at 2 ranks)
    shape = {"batch": 2, "seq": 16 * world, "dim": 32 * world, "hidden": 64 * world, "heads": 4 * world}
    check_shape("tp_sp_block", shape, world)
    print(f"commopt demo: LlamaBlock(dim={shape['dim']}, heads={shape['heads']}, hidden={shape['hidden']}), "
          f"TP+SP over {world} ranks, backend={backend}, options={options or '{}'}")
    results = run_distributed(_demo_rank, world, options, shape, backend=backend)
    report = results[0]
    print(report["explain"])
    print(f"\nnumerics vs float64 eager (rank 0; tolerance {TOLERANCE_FACTOR:g} x eager float32's own error):")
    print(f"  {'tensor':34s} {'commopt':>10s} {'eager':>10s}  ok")
    for name, compiled, eager, ok in report["errors"]:
        print(f"  {name:34s} {compiled:10.2e} {eager:10.2e}  {'yes' if ok else 'NO'}")
    failed = [name for r in results for name, *_, ok in r["errors"] if not ok]
    print(f"\n{'FAILED: ' + ', '.join(sorted(set(failed))) if failed else 'all outputs and gradients within tolerance'}"
          f" ({report['seconds']:.1f}s on rank 0)")
    return 1 if failed else 0
