"""The low-latency one-shot and two-shot all-reduces (kernels/gpu/lowlat.py) on GPUs: every result equal to its
reference's bits (gather_sum), eager and replayed from a CUDA graph with eager calls between, in
production and in debug mode, and the barrier flags at rest afterwards."""

from __future__ import annotations

import pytest
from lowlat_cases import run_matmul_oneshot, run_oneshot

from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_low_latency_all_reduce_gives_the_reference_bits(two_ranks, debug, two_shot):
    world, backend = two_ranks
    for bad in run_distributed(run_oneshot, world, debug, two_shot, backend=backend, timeout_s=300):
        assert not bad, bad


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["oneshot", "twoshot"])
def test_matmul_ar_low_latency_gives_the_reference_bits(two_ranks, schedule):
    world, backend = two_ranks
    for bad in run_distributed(run_matmul_oneshot, world, schedule, backend=backend, timeout_s=300):
        assert not bad, bad


@pytest.mark.gpu
def test_calibration_times_the_small_all_reduces_alike_on_every_rank(two_ranks):
    from lowlat_cases import run_small_message_calibration

    world, backend = two_ranks
    for table, bad in run_distributed(run_small_message_calibration, world, backend=backend, timeout_s=300):
        assert not bad, bad
        assert backend != "nccl" or "sequential" in table, table  # NCCL is captured on GPUs of their own


@pytest.mark.gpu
def test_a_decode_projection_under_reduce_overhead_measures_the_low_latency_schedules(two_ranks):
    from lowlat_cases import run_compiled_decode_projection

    world, backend = two_ranks
    for bad, notes, ran in run_distributed(run_compiled_decode_projection, world, backend=backend, timeout_s=400):
        assert not bad, bad
        assert any("replayed small all-reduce" in n for n in notes), notes
        assert ran and ran[0] in ("sequential", "oneshot", "twoshot"), (ran, notes)


@pytest.mark.gpu
def test_captures_succeed_while_the_watchdog_polls(two_ranks):
    """The watchdog's thread copies the status words of watched runtimes at every poll; in the
    default capture mode that copy, made while another thread captures, failed and invalidated the
    capture (CUDA error 900): its thread now runs in relaxed capture mode."""
    from lowlat_cases import run_captures_while_watched

    world, backend = two_ranks
    for bad in run_distributed(run_captures_while_watched, world, backend=backend, timeout_s=300):
        assert not bad, bad
