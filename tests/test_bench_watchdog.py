"""bench_watchdog's paired cost: each round's on / off ratio, so that a drift of the GPU's clocks
between rounds (a power cap) cancels instead of landing on one mode's median."""

from __future__ import annotations

import pytest

from benchmarks.bench_watchdog import _paired


def test_a_drift_between_rounds_cancels_in_the_paired_cost():
    # the clocks drift 30% over the run, the watchdog costs 1% in every round
    off = [1.0 + 0.1 * r for r in range(4)]
    raw = {"on": {"gpu_ms": [t * 1.01 for t in off]}, "off": {"gpu_ms": off}}
    q1, median, q3 = _paired(raw)
    assert median == pytest.approx(1.0) and q1 == pytest.approx(1.0) and q3 == pytest.approx(1.0)


def test_the_quartiles_show_the_rounds_spread():
    raw = {"on": {"gpu_ms": [1.1, 1.0, 1.02, 0.99]}, "off": {"gpu_ms": [1.0] * 4}}
    q1, median, q3 = _paired(raw)
    assert q1 < 0 < median < q3 and median == pytest.approx(1.0)
