"""Symmetric memory bounded on GPUs: past one rank's byte cap every rank runs NCCL (exact results,
logged), and a purpose's superseded buffer is released on every rank (count and memory)."""

from __future__ import annotations

import pytest
from symm_cap_cases import run_cap_fallback, run_supersede

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.gpu
def test_a_cap_reached_on_one_rank_runs_nccl_on_every_rank_on_gpus(two_ranks):
    world, backend = two_ranks
    for rank, (results, ops_lines, cap_lines, held, expected) in enumerate(
            run_distributed(run_cap_fallback, world, backend=backend, timeout_s=300)):
        bad = [f"{name}: error {err:.2e} vs reference {ref:.2e}" for name, err, ref in results
               if not within_tolerance(err, ref)]
        assert not bad, "\n".join(bad)
        refused = [line for line in ops_lines if "running sequential" in line]
        assert len(refused) == 2, ops_lines  # the 64 MiB class (voted), the 128 MiB one (at once)
        assert "not allocated on every rank" in refused[0] and "already failed" in refused[1], refused
        if rank == world - 1:  # the rank whose cap refused says so, with the figures
            assert len(cap_lines) == 1 and "cap of 40 MiB" in cap_lines[0] and "MiB held" in cap_lines[0], cap_lines
        else:
            assert cap_lines == [], cap_lines
        assert held == expected, (rank, held, expected)  # the flag array and the 16 MiB class, nothing refused


@pytest.mark.gpu
def test_a_superseded_own_buffer_is_released_on_every_rank_on_gpus(two_ranks):
    world, backend = two_ranks
    for rank, (ok_first, ok_second, freed, grown, difference, lost) in enumerate(
            run_distributed(run_supersede, world, backend=backend, timeout_s=300)):
        assert ok_first and ok_second, (rank, ok_first, ok_second)  # peers' writes land in either buffer
        assert freed, rank  # the runtime let the first buffer's tensor go
        # the count: the first buffer's footprint out, the second's (a class twice as large) in
        assert grown == difference > 0, (rank, grown, difference)
        if lost is not None:  # the device got the first buffer's memory back: 64 MiB in, 32 out
            assert lost < 50, f"rank {rank}: {lost} MiB of device memory lost over a 32 -> 64 MiB growth"
