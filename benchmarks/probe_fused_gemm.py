"""One GPU: the fused AG+GEMM consumer kernel (pointer loads vs TMA) against cuBLAS.

The fused schedule's persistent Triton GEMM (kernels/gpu/ag_matmul.launch_fused) run on one
GPU as rank 0 of a world of 2, the peer's shard already in its slot and its flags set, so
what is timed is the kernel alone: no copy engine, no waiting.  Shapes: the kernels issue's
AG+GEMM sweep at world 2 (gathered M, K, N/2), weights as nn.Linear's transposed.

    python benchmarks/probe_fused_gemm.py OUTDIR
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from torch_commopt.kernels.gpu.ag_matmul import launch_fused  # noqa: E402

SHAPES = [(8192, 8192, 4096), (16384, 8192, 4096), (4096, 8192, 14336), (16384, 8192, 14336)]
FLAG_BASE = 1024


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
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    flags = torch.zeros(FLAG_BASE + 4 * 256, dtype=torch.int32, device="cuda")
    flags[FLAG_BASE + 256: FLAG_BASE + 512] = 1  # every chunk of slot 1 (the peer) has landed
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    records = []
    for m, k, n in SHAPES:
        m_loc = m // 2
        gen = torch.Generator(device="cuda").manual_seed(m + n)
        a2 = torch.randn(m_loc, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        slots2 = torch.randn(2 * m_loc, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
        w = weight.t()
        gathered = torch.cat([a2, slots2[m_loc:]])
        ref = torch.mm(gathered, w)
        rec = {"M": m, "K": k, "N": n, "cublas_ms": timed(lambda: torch.mm(gathered, w)), "fused": {}}
        for tma in (0, 1):
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def run():
                launch_fused(a2, slots2, flags, status, [w], [None], [c], lin=m_loc, rank=0, world=2,
                             chunk_rows=m_loc, flag_base=FLAG_BASE, params={"tma": tma})
            try:
                c.zero_()
                run()
                torch.cuda.synchronize()
                err = float((c.float() - ref.float()).norm() / ref.float().norm())
                rec["fused"][f"tma={tma}"] = {"ms": timed(run), "rel_err_vs_cublas": err}
            except Exception as e:  # noqa: BLE001
                rec["fused"][f"tma={tma}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d")}
    (out / "fused_gemm.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
