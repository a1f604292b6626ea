"""What does splitting an all-gather GEMM per shard cost, and can a second stream win it back?

One GPU, bf16, K = 8192, world 2.  For each (shard rows m, N local): one GEMM over all 2m
rows; the two per-shard GEMMs ce_push:1 runs, on one stream; the same two on two streams
(the second forked at the start, as ag ce_push par=1 does); and an uneven split (L rows
sized to whole waves of 128x256 tiles, then 2m - L rows: the premise of a rejected
"lead" variant, kept as evidence).  Each variant is 20 back-to-back calls replayed from a
CUDA graph; median of 15 replays.  Prints and writes probe_gemm_split.json.

With the peer's shard arriving late (the `*_arrival_ms` fields): a third stream sleeps for the
time the shard takes over NVLink (its bytes at 300 GB/s plus 5 us) and the GEMMs that read it
wait for that: ce_push:1 on one stream (own GEMM, then the peer's), par=1 (the peer's GEMM on
a second stream, beside the own one) and gemm=whole (one GEMM over both shards after the
arrival).  Only the GEMMs' side of the schedules: no copy engine traffic, no flags.

    python3 benchmarks/probe_gemm_split.py OUTDIR
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import torch
from replay_timing import replayed_ms_per_call  # benchmarks/, the script's own folder

K, CALLS, REPLAYS = 8192, 20, 15
CASES = [(8192, 14336), (8192, 4096), (4096, 4096), (2048, 14336), (1024, 4096), (256, 4096)]
LINK_BYTES_PER_S, LINK_LATENCY_S = 300e9, 5e-6


def _waves(rows: int, n: int, sms: int) -> int:
    return math.ceil(math.ceil(rows / 128) * math.ceil(n / 256) / sms)


def _wave_split(m: int, n: int, sms: int) -> int:
    """Largest L <= m (multiple of 128) whose GEMM is a whole number of waves, else m // 2."""
    for lead in range(m // 128 * 128, 127, -128):
        if lead < m and (lead // 128) * math.ceil(n / 256) % sms == 0:
            return lead
    return m // 2


def _sleep_cycles_per_s() -> float:
    """torch.cuda._sleep's spin rate on this GPU (cycles per second), timed once."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def _time(parts: list[int], n: int, streams: int = 1, arrival_cycles: int = 0) -> float:
    """ms of one call: GEMMs over consecutive row blocks `parts`; with streams=2 the blocks
    after the first run on a second stream forked at the start and joined at the end.  With
    arrival_cycles, the blocks after the first (all of them, for one block) wait for a third
    stream that sleeps that long from the call's start: the peer shard's arrival."""
    rows = sum(parts)
    a = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(K, n, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    bounds = [sum(parts[:i]) for i in range(len(parts) + 1)]
    other, link = torch.cuda.Stream(), torch.cuda.Stream()
    arrived = torch.cuda.Event()

    def call():
        cur = torch.cuda.current_stream()
        if arrival_cycles:
            link.wait_stream(cur)
            with torch.cuda.stream(link):
                torch.cuda._sleep(arrival_cycles)
                arrived.record()
        if streams == 2:
            other.wait_stream(cur)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            s = other if streams == 2 and i > 0 else cur
            if arrival_cycles and (i > 0 or len(parts) == 1):
                s.wait_event(arrived)
            with torch.cuda.stream(s):
                torch.mm(a[lo:hi], w, out=out[lo:hi])
        if streams == 2:
            cur.wait_stream(other)
        if arrival_cycles:
            cur.wait_stream(link)

    return replayed_ms_per_call(call, calls=CALLS, replays=REPLAYS)


def main() -> None:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    records = []
    cycles_per_s = _sleep_cycles_per_s()
    for m, n in CASES:
        arrival_s = m * K * 2 / LINK_BYTES_PER_S + LINK_LATENCY_S
        late = int(arrival_s * cycles_per_s)
        lead = _wave_split(m, n, sms)
        rec = {"m_shard": m, "n": n, "k": K, "sms": sms, "one_gemm_ms": _time([2 * m], n),
               "per_shard_ms": _time([m, m], n), "per_shard_two_streams_ms": _time([m, m], n, streams=2),
               "wave_split_rows": lead, "wave_split_ms": _time([lead, 2 * m - lead], n),
               "waves_128x256": {"one": _waves(2 * m, n, sms), "per_shard": 2 * _waves(m, n, sms),
                                 "wave_split": _waves(lead, n, sms) + _waves(2 * m - lead, n, sms)},
               "arrival_ms": arrival_s * 1e3,
               "per_shard_arrival_ms": _time([m, m], n, arrival_cycles=late),
               "per_shard_two_streams_arrival_ms": _time([m, m], n, streams=2, arrival_cycles=late),
               "one_gemm_arrival_ms": _time([2 * m], n, arrival_cycles=late)}
        records.append(rec)
        print(json.dumps(rec), flush=True)
    (out / "probe_gemm_split.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                           "torch": torch.__version__, "records": records}, indent=1))


if __name__ == "__main__":
    main()
