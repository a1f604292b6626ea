"""The flex backward's tile pick (kernels/attention/flex_tiles.py) on the CPU: the timing replaced
by given times (no CUDA here), the calls counted."""

from __future__ import annotations

import logging

import pytest

from torch_commopt.kernels.attention import flex_tiles


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(flex_tiles, "_PICKED", {})
    monkeypatch.delenv("TORCH_COMMOPT_FLEX_BWD_TILES", raising=False)
    monkeypatch.setattr(flex_tiles.torch.cuda, "is_current_stream_capturing", lambda: False)


class Calls:
    """call(options) that records which configuration each call ran, returning its name; timed by
    `ms` (name -> ms, or an exception to raise)."""

    def __init__(self, monkeypatch, ms: dict) -> None:
        self.ran, self.ms = [], ms
        names = {tuple(sorted(o.items())): n for n, o in flex_tiles.CONFIGS.items()}
        self.name_of = lambda options: names[tuple(sorted(options.items()))]

        def time_ms(call, options):
            call(options)
            got = self.ms[self.name_of(options)]
            if isinstance(got, Exception):
                raise got
            return got

        monkeypatch.setattr(flex_tiles, "_time_ms", time_ms)

    def __call__(self, options: dict) -> str:
        self.ran.append(self.name_of(options))
        return self.ran[-1]


@pytest.mark.parametrize("faster", ["small", "default"])
def test_auto_times_every_configuration_once_and_keeps_the_faster(monkeypatch, faster):
    calls = Calls(monkeypatch, {"default": 2.0, "small": 1.0} if faster == "small" else {"default": 1.0, "small": 2.0})
    assert flex_tiles.run(("k",), calls) == faster
    assert sorted(calls.ran[:-1]) == ["default", "small"]  # each measured, then the call itself
    calls.ran.clear()
    assert [flex_tiles.run(("k",), calls) for _ in range(3)] == [faster] * 3
    assert calls.ran == [faster] * 3  # no measuring again
    assert flex_tiles.picked() == {("k",): faster}


def test_another_key_is_measured_again(monkeypatch):
    calls = Calls(monkeypatch, {"default": 2.0, "small": 1.0})
    flex_tiles.run(("a",), calls)
    calls.ms = {"default": 1.0, "small": 2.0}
    assert flex_tiles.run(("b",), calls) == "default"
    assert flex_tiles.picked() == {("a",): "small", ("b",): "default"}


@pytest.mark.parametrize("name", ["small", "default", " Small "])
def test_a_fixed_configuration_runs_without_measuring(monkeypatch, name):
    monkeypatch.setenv("TORCH_COMMOPT_FLEX_BWD_TILES", name)
    calls = Calls(monkeypatch, {"default": RuntimeError("timed"), "small": RuntimeError("timed")})
    assert flex_tiles.run(("k",), calls) == name.strip().lower()
    assert flex_tiles.picked() == {}


def test_an_unknown_value_is_logged_and_read_as_default(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_COMMOPT_FLEX_BWD_TILES", "tiny")
    calls = Calls(monkeypatch, {"default": 1.0, "small": 0.5})
    with caplog.at_level(logging.WARNING, logger=flex_tiles.log.name):
        assert flex_tiles.run(("k",), calls) == "default"
    assert "TORCH_COMMOPT_FLEX_BWD_TILES='tiny'" in caplog.text


def test_a_configuration_that_fails_is_left_out_and_logged(monkeypatch, caplog):
    calls = Calls(monkeypatch, {"default": 2.0, "small": RuntimeError("out of shared memory")})
    with caplog.at_level(logging.WARNING, logger=flex_tiles.log.name):
        assert flex_tiles.run(("k",), calls) == "default"
    assert "out of shared memory" in caplog.text


def test_the_default_failing_is_the_calls_own_error(monkeypatch):
    calls = Calls(monkeypatch, {"default": ValueError("bad mask"), "small": 1.0})
    with pytest.raises(ValueError, match="bad mask"):
        flex_tiles.run(("k",), calls)


def test_inside_a_capture_a_key_not_measured_runs_the_default_and_is_measured_later(monkeypatch):
    calls = Calls(monkeypatch, {"default": 2.0, "small": 1.0})
    monkeypatch.setattr(flex_tiles.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert flex_tiles.run(("k",), calls) == "default"
    assert calls.ran == ["default"] and flex_tiles.picked() == {}
    monkeypatch.setattr(flex_tiles.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert flex_tiles.run(("k",), calls) == "small"
    monkeypatch.setattr(flex_tiles.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert flex_tiles.run(("k",), calls) == "small"  # measured before: the pick runs in a capture too


def test_small_tiles_divide_a_mask_block():
    small = flex_tiles.SMALL
    for name in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
        assert 128 % small[name] == 0
    assert small["BLOCK_N1"] % small["BLOCK_M1"] == 0 and small["BLOCK_M2"] % small["BLOCK_N2"] == 0
