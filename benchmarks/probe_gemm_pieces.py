"""A reduction's GEMM pieces on one GPU: the whole local GEMM against its halves and quarters
(mm into row slices, and addmm_ adding into them as the W = 2 reductions' own pieces do), alone
and beside a device-local copy of half the product (a stand-in for the copy engine's traffic).
Each variant: 10 back-to-back calls replayed from a CUDA graph, median of 15 replays (ms per
call).  Shapes (rows, K_local, N): the tuner's reduce-scatter probe and three sweep shapes.

    python3 benchmarks/probe_gemm_pieces.py OUT.json

Session 48 (2x H100): under graph capture cuBLAS ran the whole 8192 x 4096 x 8192 GEMM at 0.893
ms against 0.718 eagerly (a profile of the same call), so the replayed figures here are not the
eager ones; benchmarks/NOTES.md, session 48.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
from replay_timing import replayed_ms_per_call  # benchmarks/, the script's own folder

SHAPES = [(12288, 3072, 6144), (8192, 4096, 8192), (16384, 4096, 8192), (4096, 4096, 7168)]


def _pieces(a, w, c, pieces: int, add: bool):
    """The GEMM over `pieces` consecutive row blocks, into (or, add: adding into) c's rows."""
    rows = a.shape[0]

    def call():
        for i in range(pieces):
            lo, hi = i * rows // pieces, (i + 1) * rows // pieces
            if add:
                c[lo:hi].addmm_(a[lo:hi], w)
            else:
                torch.mm(a[lo:hi], w, out=c[lo:hi])
    return call


def _beside(fn, side, dst, src):
    """fn on the current stream while `side` copies src into dst."""
    def call():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src)
        fn()
        torch.cuda.current_stream().wait_stream(side)
    return call


def probe(rows: int, k: int, n: int) -> dict[str, float]:
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    c = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(rows // 2, n, device="cuda", dtype=torch.bfloat16)
    dst, side = torch.empty_like(src), torch.cuda.Stream()
    variants = {"mm1": _pieces(a, w, c, 1, False), "mm2": _pieces(a, w, c, 2, False), "mm4": _pieces(a, w, c, 4, False),
                "addmm2": _pieces(a, w, c, 2, True), "addmm4": _pieces(a, w, c, 4, True),
                "copy_half": lambda: dst.copy_(src),
                "mm4_beside_copy": _beside(_pieces(a, w, c, 4, False), side, dst, src),
                "addmm4_beside_copy": _beside(_pieces(a, w, c, 4, True), side, dst, src)}
    return {name: replayed_ms_per_call(fn, calls=10, replays=15) for name, fn in variants.items()}


def main() -> None:
    out = {}
    for rows, k, n in SHAPES:
        out[f"{rows}x{k}x{n}"] = r = probe(rows, k, n)
        print(rows, k, n, {name: round(ms, 4) for name, ms in r.items()}, flush=True)
    pathlib.Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
