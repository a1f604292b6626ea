"""probe_flex_blocks' derived bounds and report on synthetic times (the probe itself needs a GPU)."""

import pytest

from benchmarks import probe_flex_blocks as probe


def _case() -> dict:
    lay = {"tiles": [400, 380], "fwd": [0.4, 0.5], "bwd": [1.2, 1.3],
           "own": {"fwd": [0.35, 0.4], "bwd": [0.9, 1.1]}}
    return {"mask": "docs 1K", "seq": 16384, "world": 2, "tiles_whole": 780, "tiles_rank": 380,
            "blocks_computed": 2, "fwd_error": 1e-3, "dq_error": 1e-3, "dq_scale": 1.0,
            "ms": {"whole fwd": 0.7, "whole bwd": 1.8, "rank fwd": 0.5, "rank bwd": 1.5},
            "layouts": {"contiguous": lay, "by_work": {k: v for k, v in lay.items() if k != "own"}}}


def test_the_shares_alone_bound_is_the_whole_kernel_over_world_times_the_slowest_share():
    lay = probe.derive([_case()])[0]["layouts"]
    # slowest share alone: 0.4 + 1.1 = 1.5 ms; whole 2.5 ms over 2 ranks
    assert lay["contiguous"]["bound"]["alone"] == pytest.approx(2.5 / (2 * 1.5))
    assert lay["contiguous"]["bound"]["fwd+bwd"] == pytest.approx(2.5 / (2 * 1.8))
    assert "alone" not in lay["by_work"]["bound"]


def test_the_report_shows_the_shares_alone_only_for_the_contiguous_layout():
    meta = {"device": "GPU", "commit": "abc", "date": "d", "torch": "t", "rounds": 3}
    rows = [line for line in probe.report(probe.derive([_case()]), meta).splitlines() if line.startswith("| docs 1K")]
    layout_rows = [r for r in rows if "contiguous" in r or "by_work" in r]
    assert layout_rows[0].endswith("| 0.833 |") and "contiguous" in layout_rows[0]
    assert layout_rows[1].endswith("| - |") and "by_work" in layout_rows[1]
