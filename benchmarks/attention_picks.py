"""The attention cost model's picks replayed over a stored bench_attention.py run (CPU only: it
reads the JSON): per case, today's model's first schedule (attention.cost.rank_schedules with
its depths, the device's calibration prior, the copy-engine all-to-alls with concurrent head
groups as on CUDA), its measured time and the measured best, and how many picks land within 5%
of the best.  A replay, not a measurement: the times are the run's.

    python3 -m benchmarks.attention_picks benchmarks/results/attention_h200x2_2026-11-28.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torch_commopt.kernels.attention import ce_a2a  # noqa: E402
from torch_commopt.tuner.attention.cost import machine_from_calibration, rank_schedules  # noqa: E402
from torch_commopt.tuner.calibration import prior  # noqa: E402


def measured(schedules_ms: dict, pick: str):
    """The run's time of `pick`; a plain name the run timed under its depth's name or vice versa."""
    if pick in schedules_ms:
        return schedules_ms[pick]
    base = pick.split(":g=")[0]
    return schedules_ms.get(base)


def replay(run: dict, tolerance: float = 0.05) -> tuple[list[dict], int]:
    for name in (ce_a2a.ENV, ce_a2a.GROUP_STREAMS_ENV):  # as on CUDA by default
        os.environ.pop(name, None)
    machine = machine_from_calibration(prior(run["device"], run["world"]), run["dtype"])
    rows, hits = [], 0
    for r in run["records"]:
        shape = (r["B"], r["H"], r["H_kv"], r["S_total"], r["D"])
        ranked = rank_schedules(shape, world=r["world"], causal=r["causal"], dtype=run["dtype"],
                                backward=r["pass"] == "fwd+bwd", depths=True, machine=machine)
        pick, ms = ranked[0][0], r["schedules_ms"]
        best = min(ms, key=ms.get)
        got = measured(ms, pick)
        ok = got is not None and got <= (1 + tolerance) * ms[best]
        hits += ok
        rows.append({"case": f"B{r['B']} H{r['H']}/{r['H_kv']} S{r['S_total']} {'causal' if r['causal'] else 'full'} "
                             f"{r['pass']}", "pick": pick, "pick_ms": got, "best": best, "best_ms": ms[best],
                     "within": ok})
    return rows, hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a bench_attention.py JSON")
    args = ap.parse_args()
    run = json.loads(pathlib.Path(args.run).read_text())
    rows, hits = replay(run)
    for row in rows:
        got = "-" if row["pick_ms"] is None else f"{row['pick_ms']:.3f}"
        print(f"{row['case']:40s} pick {row['pick']:14s} {got:>9s}  best {row['best']:14s} {row['best_ms']:9.3f}"
              f"  {'ok' if row['within'] else 'MISS'}")
    print(f"picks within 5% of the measured best: {hits} of {len(rows)} (run at {run.get('commit', '?')}, "
          f"{run['device']} x{run['world']})")


if __name__ == "__main__":
    main()
