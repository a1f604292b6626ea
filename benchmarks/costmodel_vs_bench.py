"""Cost model vs a matmul_collectives benchmark run: per shape and schedule, the predicted
and measured times, the median relative error, and whether the model's top-1 candidate
is within 5% of the measured best (CPU only: it reads the JSON).

    python3 -m benchmarks.costmodel_vs_bench benchmarks/results/matmul_collectives_h200x2_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torch_commopt.core.schedule import Schedule  # noqa: E402
from torch_commopt.tuner.calibration import Calibration, prior  # noqa: E402
from torch_commopt.tuner.matmul.model import RegionShape, predict, rank  # noqa: E402

KIND = {"ag": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar"}


def region_shape(r: dict) -> RegionShape:
    w = r["world"]
    if r["op"] == "ag":  # local shard rows, weight column-sharded
        return RegionShape("ag_matmul", r["M"] // w, r["K"], (r["N"] // w,), w, r["dtype"])
    return RegionShape(KIND[r["op"]], r["M"], r["K"] // w, (r["N"],), w, r["dtype"])


def compare(records: list[dict], calibration: Calibration | None = None) -> tuple[list[dict], float, int]:
    """calibration: a measured one (else the priors of the record's device)."""
    rows, errors, hits = [], [], 0
    for r in records:
        shape, cal = region_shape(r), calibration or prior(r.get("device", "NVIDIA H200"), r["world"])
        measured = {"sequential": r["nccl_seq_ms"], **r["schedules"]}  # the op's own sequential if timed
        for s, ms in measured.items():
            p = predict(shape, Schedule.parse(s), cal).seconds * 1e3
            errors.append(abs(p - ms) / ms)
            rows.append({"op": r["op"], "M": r["M"], "K": r["K"], "N": r["N"], "world": r["world"],
                         "candidate": s, "predicted_ms": p, "measured_ms": ms})
        top = str(rank(shape, cal, [Schedule.parse(s) for s in measured])[0].schedule)
        hits += measured[top] <= 1.05 * min(measured.values())
    return rows, statistics.median(errors), hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--calibration", help="a tuner-cache calibration entry (JSON) to use instead of the priors")
    args = parser.parse_args()
    records = json.loads(pathlib.Path(args.bench_json).read_text())
    cal = None
    if args.calibration:
        entry = json.loads(pathlib.Path(args.calibration).read_text())
        cal = Calibration.from_json(json.dumps(entry.get("value", entry)))
    rows, median_err, hits = compare(records, cal)
    for row in rows:
        print(f"{row['op']} {row['M']}x{row['K']}x{row['N']} {row['candidate']:<32} "
              f"predicted {row['predicted_ms']:.3f} measured {row['measured_ms']:.3f}")
    print(f"median |predicted - measured| / measured: {median_err:.3f}; "
          f"top-1 within 5% of the measured best on {hits} of {len(records)} shapes")


if __name__ == "__main__":
    main()
