"""One GPU: can a Triton GEMM with TMA loads match cuBLAS on the fused AG+GEMM's shapes?

The fused all-gather+GEMM (kernels/gpu/triton_kernels.py, ag_gemm_kernel) loads its tiles with
pointer arithmetic; it runs ~10% behind cuBLAS at 16384x8192x28672 (benchmarks/NOTES.md), which
holds that shape's hidden fraction near 0.78.  This probe times, with no flags and no peers:

    cublas        torch.mm
    pointer       a persistent grouped-order GEMM with pointer loads (the fused kernel's loop)
    tma           the same persistent loop with TMA tensor-descriptor loads and stores

for the per-rank shapes of the kernels issue's AG+GEMM sweep (world 2: the gathered A (M, K)
times the weight's column shard (K, N/2), given as nn.Linear's (N/2, K) weight transposed),
over a few tile configurations, and checks each result against cuBLAS.

    python benchmarks/probe_triton_gemm.py OUTDIR
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

SHAPES = [(8192, 8192, 4096), (16384, 8192, 4096), (4096, 8192, 14336), (16384, 8192, 14336)]
CONFIGS = [  # BM, BN, BK, GROUP_M, stages, warps
    (128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 5, 8),
    (256, 128, 64, 8, 3, 8)]


@triton.jit
def _coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    width = GROUP_M * tiles_n
    first_m = (tile // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m


@triton.jit
def pointer_gemm(a, w, c, M, N, K, NUM_PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    """c (M, N) = a (M, K) @ w (N, K)^T; persistent over tiles in grouped order."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGS):
        pm, pn = _coords(tile, tiles_m, tiles_n, GROUP_M)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptr = a + rows.to(tl.int64)[:, None] * K + ks[None, :]
        w_ptr = w + cols.to(tl.int64)[None, :] * K + ks[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            acc = tl.dot(tl.load(a_ptr), tl.load(w_ptr), acc)
            a_ptr += BK
            w_ptr += BK
        tl.store(c + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(c.dtype.element_ty))


@triton.jit
def tma_gemm(a_desc, w_desc, c_desc, M, N, K, NUM_PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    """As pointer_gemm, tiles moved by the TMA unit (descriptors built on the host)."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGS, flatten=True):
        pm, pn = _coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            a_blk = a_desc.load([pm * BM, kb * BK])
            w_blk = w_desc.load([pn * BN, kb * BK])
            acc = tl.dot(a_blk, w_blk.T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(c_desc.dtype))


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return statistics.median(rounds)


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for m, k, n in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        ref = torch.mm(a, w.t())
        flops = 2 * m * n * k
        rec = {"M": m, "K": k, "N": n, "cublas_ms": timed(lambda: torch.mm(a, w.t())), "variants": {}}
        for bm, bn, bk, group, stages, warps in CONFIGS:
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            progs = min(sms, tiles)
            runs = {
                "pointer": lambda: pointer_gemm[(progs,)](a, w, c, m, n, k, progs, bm, bn, bk, group, stages,
                                                          num_warps=warps, num_stages=stages),
                "tma": lambda: tma_gemm[(progs,)](
                    TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
                    TensorDescriptor.from_tensor(c, [bm, bn]), m, n, k, progs, bm, bn, bk, group, stages,
                    num_warps=warps, num_stages=stages),
            }
            for kind, fn in runs.items():
                key = f"{kind} {bm}x{bn}x{bk} g{group} s{stages} w{warps}"
                try:
                    c.zero_()
                    fn()
                    torch.cuda.synchronize()
                    err = float((c.float() - ref.float()).norm() / ref.float().norm())
                    ms = timed(fn)
                    rec["variants"][key] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err": err}
                except Exception as e:  # noqa: BLE001  (a config that does not compile is a finding)
                    rec["variants"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(m, k, n, key, rec["variants"][key], flush=True)
        best = {kind: min((v["ms"] for key, v in rec["variants"].items() if key.startswith(kind) and "ms" in v),
                          default=None) for kind in ("pointer", "tma")}
        rec["best_ms"] = best
        rec["cublas_tflops"] = flops / rec["cublas_ms"] / 1e9
        records.append(rec)
        print(json.dumps({"M": m, "K": k, "N": n, "cublas_ms": rec["cublas_ms"], "best": best}), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d")}
    (out / "triton_gemm.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
