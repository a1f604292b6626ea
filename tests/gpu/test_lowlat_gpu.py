"""The low-latency one-shot all-reduce (kernels/gpu/lowlat.py) on GPUs: every result equal to its
reference's bits (gather_sum), eager and replayed from a CUDA graph with eager calls between, in
production and in debug mode, and the barrier flags at rest afterwards."""

from __future__ import annotations

import pytest
from lowlat_cases import run_matmul_oneshot, run_oneshot

from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
@pytest.mark.parametrize("debug", [False, True], ids=["production", "debug"])
def test_oneshot_all_reduce_gives_the_reference_bits(two_ranks, debug):
    world, backend = two_ranks
    for bad in run_distributed(run_oneshot, world, debug, backend=backend, timeout_s=300):
        assert not bad, bad


@pytest.mark.gpu
def test_matmul_ar_oneshot_gives_the_reference_bits(two_ranks):
    world, backend = two_ranks
    for bad in run_distributed(run_matmul_oneshot, world, backend=backend, timeout_s=300):
        assert not bad, bad
