"""One GPU: what bench_attention's lead call does to its single-GPU baseline.

bench_attention queues --lead untimed calls right before each sample's timed ones (default 1
since session 52), for every variant alike.  Its efficiency divides the single-GPU time by W x
commopt's, so a lead that made the single-GPU call itself slower (a busier, hotter device) would
inflate the efficiency instead of removing the idle start from commopt's samples.  One machine in
session 51 read the single-GPU 16K baseline 13.959 ms without a lead and 14.366 with one (two
runs, one each).  This times the baseline with leads 0 and 1 (and --leads) in alternating order
within each round, bench_attention's samples (>= --target-ms of back-to-back calls), and reports
the medians and the per-round ratios to lead 0.

    python benchmarks/probe_lead.py OUTDIR [--seq 16384,32768] [--heads 32/32,32/8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_attention import TARGET_MS, Case, Clock, _full_inputs, sample_calls, single_gpu  # noqa: E402


def rounds_ms(step, clock: Clock, leads: list[int], rounds: int, target_ms: float) -> dict[int, list[float]]:
    """{lead: [ms per call in each round]}, the leads visited in a rotated order per round."""
    count = sample_calls(step, clock, target_ms)
    got = {lead: [] for lead in leads}
    for r in range(rounds):
        for lead in leads[r % len(leads):] + leads[:r % len(leads)]:
            got[lead].append(clock.time_ms(step, count, lead))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seq", default="16384,32768")
    ap.add_argument("--heads", default="32/32,32/8")
    ap.add_argument("--leads", default="0,1")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--target-ms", dest="target_ms", type=float, default=TARGET_MS)
    ap.add_argument("--commit", default="?")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    leads = [int(x) for x in args.leads.split(",")]
    clock, records = Clock("cuda"), []
    for s in (int(x) for x in args.seq.split(",")):
        for pair in args.heads.split(","):
            h, h_kv = (int(x) for x in pair.split("/"))
            case = Case(1, h, h_kv, 128, s, True, "fwd+bwd")
            full = _full_inputs(case, torch.bfloat16, "cuda")
            with single_gpu(case, full) as (step, _):
                got = rounds_ms(step, clock, leads, args.rounds, args.target_ms)
            base = got[leads[0]]
            rec = {"S": s, "H": h, "H_kv": h_kv, "median_ms": {str(k): statistics.median(v) for k, v in got.items()},
                   "ratio_to_first_median": {str(k): statistics.median(a / b for a, b in zip(v, base))
                                             for k, v in got.items()},
                   "rounds_ms": {str(k): v for k, v in got.items()}}
            records.append(rec)
            print(f"S {s} H {h}/{h_kv}: " + "; ".join(f"lead {k} {rec['median_ms'][str(k)]:.3f} ms "
                                                       f"(x{rec['ratio_to_first_median'][str(k)]:.4f})" for k in leads),
                  flush=True)
            del full
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": args.commit,
            "rounds": args.rounds, "target_ms": args.target_ms, "leads": leads}
    (out / "lead_single.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
