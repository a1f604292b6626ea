"""One GPU: the fused GEMM kernels (pointer loads vs TMA) against cuBLAS.

The fused schedules' persistent Triton GEMMs run on one GPU as rank 0 of a world of 2 with
local stand-ins for the peer, so what is timed is the kernel alone: no copy engine, no
waiting.  AG+GEMM (kernels/gpu/ag_matmul.launch_fused): the peer's shard already in its slot
and its flags set; shapes: the kernels issue's AG+GEMM sweep at world 2 (gathered M, K,
N/2).  GEMM+RS (kernels/gpu/matmul_reduce.launch_rs_fused): the peer's partial already
received, its segment stored into a local stand-in of its buffer (direct) or the send
buffer (ce); shapes: the GEMM+RS sweep at world 2 (M, K/2, N).  Weights as nn.Linear's
transposed.

    python benchmarks/probe_fused_gemm.py OUTDIR [--commit SHA] [--configs "128,256,64,8,3;128,256,64,8,4"]

--configs: tile configurations (bm, bn, bk, warps, stages) to time the TMA kernels with
(AG, and RS with direct stores) besides their defaults.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from probe_attention_blocks import timed  # noqa: E402  (median of rounds of back-to-back calls)

from torch_commopt.kernels.gpu.ag_matmul import launch_fused  # noqa: E402
from torch_commopt.kernels.gpu.matmul_reduce import launch_rs_fused  # noqa: E402
from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS  # noqa: E402

SHAPES = [(8192, 8192, 4096), (16384, 8192, 4096), (4096, 8192, 14336), (16384, 8192, 14336)]
RS_SHAPES = [(8192, 4096, 8192), (16384, 4096, 8192), (4096, 4096, 7168), (16384, 4096, 7168)]
FLAG_BASE = 1024


def config_params(text: str) -> list[dict]:
    return [dict(zip(("bm", "bn", "bk", "warps", "stages"), map(int, c.split(",")))) for c in text.split(";") if c]


def rs_records(configs: list[dict]) -> list[dict]:
    """The fused GEMM+RS kernel as rank 0 of 2 against cuBLAS over all M rows."""
    flags = torch.zeros(COUNTERS + 2 * MAX_CHUNKS, dtype=torch.int32, device="cuda")
    flags[COUNTERS + MAX_CHUNKS: COUNTERS + 2 * MAX_CHUNKS] = 1 << 30  # direct: the peer's tiles counted
    flags[MAX_CHUNKS: 2 * MAX_CHUNKS] = 1  # ce: the peer's partial landed (DATA flags at data_base 0)
    peer_flags = torch.zeros_like(flags)
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    records = []
    for m, k, n in RS_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(m + n + 1)
        a2 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5).t()
        m_seg = m // 2
        recv = torch.randn(2, m_seg, n, device="cuda", dtype=torch.bfloat16, generator=gen)
        peer_buf, send = torch.empty_like(recv), torch.empty_like(recv)
        out = torch.empty(m_seg, n, device="cuda", dtype=torch.bfloat16)
        recv_bases = torch.tensor([recv.data_ptr(), peer_buf.data_ptr()], dtype=torch.int64, device="cuda")
        flag_bases = torch.tensor([flags.data_ptr(), peer_flags.data_ptr()], dtype=torch.int64, device="cuda")
        ref = torch.mm(a2[:m_seg], w).float() + recv[1].float()
        rec = {"op": "rs", "M": m, "K": k, "N": n, "cublas_ms": timed(lambda: torch.mm(a2, w)), "fused": {}}
        for store in ("direct", "ce"):
            for tma in (0, 1):
                def run():
                    launch_rs_fused(a2, w, out, send, recv, recv_bases, flags, flag_bases, status, recv_off=0,
                                    data_base=0, lin=m_seg, rank=0, world=2, m_seg=m_seg, chunk_mt=8, alpha=1.0,
                                    params={"tma": tma}, direct=store == "direct", bases_aligned=True)
                try:
                    run()
                    torch.cuda.synchronize()
                    err = float((out.float() - ref).norm() / ref.norm())
                    rec["fused"][f"store={store},tma={tma}"] = {"ms": timed(run), "rel_err_vs_cublas": err}
                except Exception as e:  # noqa: BLE001
                    rec["fused"][f"store={store},tma={tma}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for cfg in configs:
            def run_cfg():
                launch_rs_fused(a2, w, out, send, recv, recv_bases, flags, flag_bases, status, recv_off=0,
                                data_base=0, lin=m_seg, rank=0, world=2, m_seg=m_seg, chunk_mt=8, alpha=1.0,
                                params={"tma": 1, **cfg}, direct=True, bases_aligned=True)
            label = "store=direct,tma=1," + ",".join(f"{k}={v}" for k, v in cfg.items())
            rec["fused"][label] = _timed_or_error(run_cfg)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    return records


def _timed_or_error(run) -> dict:
    try:
        return {"ms": timed(run)}
    except Exception as e:  # noqa: BLE001  (a configuration out of shared memory)
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--commit", default="?")
    ap.add_argument("--configs", default="")
    args = ap.parse_args()
    configs = config_params(args.configs)
    out = pathlib.Path(args.out)
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
        rec = {"op": "ag", "M": m, "K": k, "N": n, "cublas_ms": timed(lambda: torch.mm(gathered, w)), "fused": {}}
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
        for cfg in configs:
            def run_cfg():
                launch_fused(a2, slots2, flags, status, [w], [None], [c], lin=m_loc, rank=0, world=2,
                             chunk_rows=m_loc, flag_base=FLAG_BASE, params={"tma": 1, **cfg})
            rec["fused"]["tma=1," + ",".join(f"{k}={v}" for k, v in cfg.items())] = _timed_or_error(run_cfg)
        records.append(rec)
        print(json.dumps(rec), flush=True)
    records += rs_records(configs)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": args.commit, "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    (out / "fused_gemm.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
