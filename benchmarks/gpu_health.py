"""A 10-second check of the GPUs before timing anything: each GPU's bf16 GEMM rate and clocks.

A sick machine can run every GEMM 1.3-4x slower than the next machine of the same kind (an
8192^3 GEMM at 1.045 ms eager, 2.2 ms replayed, against 0.78 on the next 2x H100), which makes
every timing on it useless.  This prints one line per GPU and a warning below MIN_TFLOPS, so a run
script can tell a sick machine from a slow schedule.

    python3 benchmarks/gpu_health.py [--min-tflops 600]
"""

from __future__ import annotations

import argparse
import time

import torch

MIN_TFLOPS = 600.0  # H100 / H200 SXM measure 750-800 on an 8192^3 bf16 GEMM here


def gemm_tflops(device: int, n: int = 8192, iters: int = 50) -> float:
    a = torch.randn(n, n, device=f"cuda:{device}", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--min-tflops", type=float, default=MIN_TFLOPS)
    args = p.parse_args()
    for d in range(torch.cuda.device_count()):
        rate = gemm_tflops(d)
        flag = ("" if rate >= args.min_tflops
                else f"  WARNING: under {args.min_tflops:.0f}: timings on this machine are suspect")
        print(f"health cuda:{d} {torch.cuda.get_device_name(d)}: 8192^3 bf16 GEMM {rate:.0f} TFLOP/s{flag}")


if __name__ == "__main__":
    main()
