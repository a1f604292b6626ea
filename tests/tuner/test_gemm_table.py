"""GEMMs timed at their own shapes (tuner.gemm_table): the model prices them at their figure."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.tuner import gemm_table
from torch_commopt.tuner.calibration import Calibration, gemm_key, prior
from torch_commopt.tuner.matmul.model import RegionShape, gemm_keys, predict
from torch_commopt.tuner.probe_factors import PROBE_SHAPES, _probe_gemm_keys

H100 = prior("NVIDIA H100 80GB HBM3", 2)
RS = RegionShape("matmul_rs", 8192, 4096, (8192,), 2)  # rs 8192^3 at two ranks: K_local 4096


def test_a_timed_gemm_replaces_the_fit_and_survives_json():
    key = gemm_key("bfloat16", 2048, 8192, 4096)
    fit = H100.gemm_time("bfloat16", 2048, 8192, 4096)
    cal = dataclasses.replace(H100, gemm_table={key: 3 * fit})
    assert cal.gemm_time("bfloat16", 2048, 8192, 4096) == 3 * fit
    assert cal.gemm_time("bfloat16", 4096, 8192, 4096) == H100.gemm_time("bfloat16", 4096, 8192, 4096)  # not held
    assert Calibration.from_json(cal.to_json()).gemm_table == {key: 3 * fit}


def test_gemm_keys_list_each_schedules_pieces():
    keys = gemm_keys(RS, H100, [Schedule.parse(s) for s in ("sequential", "ce_push:1", "ce_pull:2")])
    # sequential: the whole local GEMM; ce_push:1: each rank's segment (4096 rows); ce_pull:2: its halves
    assert keys == sorted(gemm_key("bfloat16", m, 8192, 4096) for m in (8192, 4096, 2048))


def test_a_slow_piece_is_charged_to_the_schedules_that_run_it_only():
    quarter = gemm_key("bfloat16", 2048, 8192, 4096)
    slow = dataclasses.replace(H100, gemm_table={quarter: 2 * H100.gemm_time("bfloat16", 2048, 8192, 4096)})
    one, two = Schedule.parse("ce_push:1"), Schedule.parse("ce_pull:2")
    assert predict(RS, one, slow).gpu_s == pytest.approx(predict(RS, one, H100).gpu_s)
    assert predict(RS, two, slow).gpu_s > 1.5 * predict(RS, two, H100).gpu_s


def test_the_probes_gemms_cover_their_pieces():
    keys = _probe_gemm_keys(H100)
    (rows, k), (_, n) = PROBE_SHAPES["matmul_rs"]
    # the long reduce-scatter probe's 3072-row quarters (s48: 5-8% slower than the fit said)
    assert gemm_key("bfloat16", rows // 4, n, k) in keys
    assert all(key.startswith("bfloat16 ") for key in keys)


def test_nothing_is_timed_on_a_cpu(monkeypatch):
    monkeypatch.setattr(gemm_table, "time_gemms", lambda *a, **k: pytest.fail("timed on a CPU"))
    cal = prior("cpu", 2)
    shape = RegionShape("matmul_rs", 64, 64, (64,), 2, "float32")
    assert gemm_table.with_gemms(cal, shape, [Schedule.parse("sequential")], torch.device("cpu"), None, None, 1.0) is cal


def test_timed_once_then_read_from_the_cache(monkeypatch, tmp_path):
    calls = []

    def fake(keys, device, reps=3):
        calls.append(list(keys))
        return {k: 1e-3 * (i + 1) for i, k in enumerate(keys)}

    monkeypatch.setattr(gemm_table, "time_gemms", fake)
    scheds = [Schedule.parse("ce_pull:2"), Schedule.parse("sequential")]
    keys = gemm_keys(RS, H100, scheds)
    first = gemm_table.with_gemms(H100, RS, scheds, torch.device("cuda", 0), None, str(tmp_path), 1.0)
    assert calls == [keys] and set(first.gemm_table) == set(keys)
    again = gemm_table.with_gemms(H100, RS, scheds, torch.device("cuda", 0), None, str(tmp_path), 1.0)
    assert calls == [keys] and again.gemm_table == first.gemm_table  # the cache answered
    assert gemm_table.with_gemms(first, RS, scheds, torch.device("cuda", 0), None, str(tmp_path), 1.0) is first  # held


def test_a_failed_timing_keeps_the_fit_and_says_so(monkeypatch, tmp_path, caplog):
    def broken(keys, device, reps=3):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gemm_table, "time_gemms", broken)
    halves = [Schedule.parse("ce_pull:2")]  # prices one GEMM: the 2048-row pieces
    assert gemm_keys(RS, H100, halves) == [gemm_key("bfloat16", 2048, 8192, 4096)]
    with caplog.at_level(logging.WARNING, logger="torch_commopt.tuner.gemm_table"):
        cal = gemm_table.with_gemms(H100, RS, halves, torch.device("cuda", 0), None, str(tmp_path), 1.0)
    assert cal.gemm_table == {} and "the fit prices them" in caplog.text


def test_float8_gemms_are_left_to_the_fit():
    assert gemm_table.timeable([gemm_key("float8_e4m3fn", 64, 64, 64), gemm_key("bfloat16", 64, 64, 64)], H100) == \
        [gemm_key("bfloat16", 64, 64, 64)]


def test_nothing_is_timed_inside_a_capture(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_table, "time_gemms", lambda *a, **k: pytest.fail("timed inside a capture"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    halves = [Schedule.parse("ce_pull:2")]
    assert gemm_table.with_gemms(H100, RS, halves, torch.device("cuda", 0), None, str(tmp_path), 1.0) is H100
