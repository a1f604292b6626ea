"""benchmarks/costmodel_replay.py on a committed run: every shape is either a top-1 hit or listed
as a miss naming the model's top-1 and the measured best (whatever today's model predicts)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import costmodel_replay  # noqa: E402

RUN = ROOT / "benchmarks" / "results" / "costmodel_h100x2_2026-11-26_s29_summary.json"


def test_a_stored_run_replays_with_its_misses_named():
    got = costmodel_replay.replay(RUN)
    assert got["run"] == "h100x2_2026-11-26_s29" and got["shapes"] == 14
    assert got["top1_within_5pct"] + len(got["misses"]) == got["shapes"]
    for (op, m, k, n), (top, top_pred, top_meas), (best, best_pred, best_meas) in got["misses"]:
        assert top != best and top_pred <= best_pred and top_meas > 1.05 * best_meas
    assert len({key for key, *_ in got["misses"]}) == len(got["misses"])  # one entry per shape
