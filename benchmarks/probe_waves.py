"""Does cuBLAS lose a partial wave per GEMM?  The premise of ag ce_push's `lead` (pick.wave_lead).

One GPU, bf16, K = 8192.  For each N, times one GEMM over the whole gathered M, two GEMMs
over one shard each (what ce_push:1 runs), and the lead split (L rows, then 2m - L rows)
that pick.wave_lead proposes.  Each variant is 20 back-to-back calls replayed from a CUDA
graph; median of 15 replays.  Prints and writes JSON.

    python3 benchmarks/probe_waves.py OUTDIR
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torch_commopt.kernels.gpu.pick import wave_lead, waves  # noqa: E402

K, CALLS, REPLAYS = 8192, 20, 15
CASES = [(8192, 14336), (8192, 4096), (2048, 14336)]  # (shard rows m, N local) at world 2


def _time(parts: list[int], n: int) -> float:
    """ms of one call of the GEMMs over consecutive row blocks of sizes `parts`."""
    rows = sum(parts)
    a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, n, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    bounds = [sum(parts[:i]) for i in range(len(parts) + 1)]

    def call():
        for lo, hi in zip(bounds, bounds[1:]):
            torch.mm(a[lo:hi], w, out=out[lo:hi])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up: cuBLAS picks its kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def main() -> None:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    for m, n in CASES:
        lead = wave_lead(m, n, 2, sms) or m // 2
        rec = {"m_shard": m, "n": n, "k": K, "sms": sms, "lead": lead,
               "one_gemm_ms": _time([2 * m], n), "per_shard_ms": _time([m, m], n),
               "lead_split_ms": _time([lead, 2 * m - lead], n),
               "waves": {"one": waves(2 * m, n, sms), "per_shard": 2 * waves(m, n, sms),
                         "lead_split": waves(lead, n, sms) + waves(2 * m - lead, n, sms)}}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    (out / "probe_waves.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                      "torch": torch.__version__, "records": records}, indent=1))


if __name__ == "__main__":
    main()
