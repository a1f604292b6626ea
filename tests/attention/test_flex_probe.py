"""probe_flex_blocks' figures come from its raw times (the GPU run itself is on the device)."""

import pytest

from benchmarks import probe_flex_blocks as probe


def test_work_rate_ratios_come_from_the_tiles_and_the_times():
    c = {"mask": "docs 4K", "seq": 16384, "world": 2, "rank": 1, "tiles_whole": 3000, "tiles_rank": 2000,
         "blocks_computed": 2, "ms": {"whole fwd": 2.0, "whole bwd": 6.0, "rank fwd": 1.5, "rank bwd": 5.0,
                                     "allgather fwd": 1.25, "allgather bwd": 4.0},
         "fwd_error": 1e-3, "lse_error": 1e-6, "dq_error": 2e-3, "dq_scale": 2.5, "compile_s": 9.0,
         "steps_host_ms": 0.4, "steps_cached_ms": 0.01,
         "layouts": {"contiguous": {"tiles": [1000, 2000], "fwd": [0.5, 1.5], "bwd": [2.0, 4.0]},
                     "by_work": {"tiles": [1500, 1500], "fwd": [1.0, 1.1], "bwd": [3.5, 3.0]}}}
    (d,) = probe.derive([c])
    assert d["fwd_ratio"] == pytest.approx((2000 / 1.5) / (3000 / 2.0))
    assert d["bwd_ratio"] == pytest.approx((2000 / 5.0) / (3000 / 6.0))
    assert d["allgather_fwd_ratio"] == pytest.approx((2000 / 1.25) / (3000 / 2.0))
    assert d["allgather_bwd_ratio"] == pytest.approx((2000 / 4.0) / (3000 / 6.0))
    meta = {"device": "NVIDIA H200", "commit": "c", "date": "d", "torch": "t", "rounds": 10}
    assert d["layouts"]["contiguous"]["bound"]["fwd"] == pytest.approx(2.0 / (2 * 1.5))
    assert d["layouts"]["by_work"]["bound"]["fwd+bwd"] == pytest.approx(8.0 / (2 * 4.5))
    text = probe.report([d], meta)
    assert "| docs 4K | 16384 | 2 | by_work | 1500 / 1500 | 1.100 | 3.500 | 0.909 | 0.857 | 0.889 |" in text
    assert "| docs 4K | 16384 | 2 | 3000 / 2000 | 2 |" in text and text.count("| 0.40 / 0.010 |") == 1
