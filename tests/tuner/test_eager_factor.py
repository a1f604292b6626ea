"""Eager device factors: the replayed curve times the calibration's eager / replayed ratio."""

from __future__ import annotations

import dataclasses

import pytest

from torch_commopt.tuner.calibration import PER_CALL, prior
from torch_commopt.tuner.probe_factors import _eager_over_replayed

KEY = "matmul_rs ce_pull:2"
CAL = dataclasses.replace(prior("NVIDIA H100 80GB HBM3", 2),
                          schedule_factor={KEY: 1.3, "matmul_rs ce_pull": 1.3},
                          schedule_factor_curve={KEY: [[1e-4, 1.2], [6e-4, 1.3]]},  # a noisy eager long probe
                          schedule_factor_curve_graphs={KEY: [[1e-4, 1.2], [6e-4, 1.1]]},
                          call_graph_slowdown={KEY: 1.05})


def test_without_the_ratio_eager_calls_keep_the_eager_curve():
    assert CAL.factor(KEY, 6e-4) == pytest.approx(1.3)
    assert CAL.factor(KEY, 1e-3, graphs=True) == pytest.approx(1.1)


def test_with_the_ratio_eager_calls_take_the_replayed_curve_times_it():
    cal = dataclasses.replace(CAL, eager_over_replayed=1.03)
    assert cal.factor(KEY, 6e-4) == pytest.approx(1.1 * 1.03)
    assert cal.factor(KEY, 1e-4) == pytest.approx(1.2 * 1.03)
    assert cal.factor(KEY, 6e-4, graphs=True) == pytest.approx(1.1)  # replayed calls: unchanged
    assert cal.factor(KEY, 6e-4, graphs=PER_CALL) == pytest.approx(1.1 * 1.05)  # per-call graphs: unchanged
    # a schedule with no replayed curve keeps its eager factor
    other = "matmul_rs fused:1"
    cal = dataclasses.replace(cal, schedule_factor={**cal.schedule_factor, other: 1.4})
    assert cal.factor(other, 6e-4) == pytest.approx(1.4)


def test_the_ratio_is_the_median_over_schedules_probed_both_ways():
    long = {"matmul_rs ce_pull:2": (1e-3, 1.2), "matmul_rs ce_pull": (1e-3, 1.2),  # a family key: not counted twice
            "matmul_rs ce_push:1": (1e-3, 1.0), "matmul_rs direct:1": (1e-3, 1.04), "ag_matmul ce_push:4": (1e-3, 1.5)}
    replayed = {"matmul_rs ce_pull:2": (1e-3, 1.0), "matmul_rs ce_pull": (1e-3, 1.0),
                "matmul_rs ce_push:1": (1e-3, 1.0), "matmul_rs direct:1": (1e-3, 1.0)}
    assert _eager_over_replayed(long, replayed) == pytest.approx(1.04)  # of 1.2, 1.0, 1.04
    assert _eager_over_replayed(long, {}) == 0.0
