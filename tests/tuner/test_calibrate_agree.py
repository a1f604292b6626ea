"""The calibration's guards against noisy measurements: one noisy pass (calibrate.agreed), an
implausible attention backward factor."""

from __future__ import annotations

import logging

import pytest

from torch_commopt.tuner import calibrate
from torch_commopt.tuner.calibrate import AGREE, agreed, disagreeing


def test_two_passes_that_agree_give_their_median_without_a_third():
    calls = []
    first, second = {"host": 100e-6, "gemm": 1.0e-3}, {"host": 104e-6, "gemm": 0.97e-3}
    out, far = agreed([first, second], lambda: calls.append(1) or {}, "test")
    assert not calls and far == disagreeing(first, second) == []
    assert out == pytest.approx({"host": 102e-6, "gemm": 0.985e-3})


def test_a_pass_out_of_line_is_outvoted_by_a_third():
    # a calibration run once read this: one pass in a host burst (134 us against ~70-110)
    first, second, third = {"host": 134e-6, "x": 1.0}, {"host": 70e-6, "x": 1.02}, {"host": 72e-6, "x": 0.5}
    calls = []

    def another():
        calls.append(1)
        return third

    assert disagreeing(first, second) == ["host"]
    out, far = agreed([first, second], another, "test")
    assert calls == [1] and far == ["host"]
    assert out == {"host": 72e-6, "x": 1.0}  # per figure: the median of the three


def test_the_tolerance_is_relative_to_the_smaller_figure():
    edge = 1.0 + AGREE
    assert disagreeing({"a": 1.0}, {"a": edge * 0.999}) == []
    assert disagreeing({"a": 1.0}, {"a": edge * 1.001}) == ["a"]
    assert disagreeing({"a": edge * 1.001}, {"a": 1.0}) == ["a"]  # symmetric
    assert disagreeing({"a": 0.0}, {"a": 0.0}) == []


def test_the_backward_factor_is_the_median_and_a_disturbed_one_falls_back_logged(caplog):
    """A backward timed no slower than its forward (it does over twice the work) is a disturbed
    measurement: 0, the attention model's default, with a warning."""
    assert abs(calibrate._bwd_factor({"float32": (1.0, 1.0, 2.5), "bfloat16": (1.0, 2.0, 5.4),
                                      "float16": (1.0, 1.0, 2.0)}) - 2.5) < 1e-12
    with caplog.at_level(logging.WARNING, logger="torch_commopt.tuner.calibrate"):
        assert calibrate._bwd_factor({"float32": (1.0, 1.0, 0.8)}) == 0.0
    assert "disturbed" in caplog.text
