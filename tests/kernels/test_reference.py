"""Every reference schedule against plain torch on full tensors, on gloo with 2 and 4 ranks:
gather/scatter dims 0/1/2, K gathered, N scattered, bmm weights, bias, sum/avg, chunk counts
that do not divide the rows or exceed them; and the fake impls give the real shapes."""

from __future__ import annotations

import pytest

from reference_programs import run_reference_cases
from torch_commopt.launch import run_distributed
from torch_commopt.validate import within_tolerance


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reference_schedules_match_plain_torch(world):
    for results, fake_mismatch in run_distributed(run_reference_cases, world):
        assert not fake_mismatch, f"fake impl shapes differ from real ones: {fake_mismatch}"
        assert len(results) > 100
        for name, err, ref_err in results:
            assert within_tolerance(err, ref_err), f"{name}: error {err:.2e} vs plain torch {ref_err:.2e}"


def _uneven_reduce_scatter(rank: int, world: int) -> str:
    import torch
    import torch.distributed as dist

    import torch_commopt  # noqa: F401  (registers the ops)

    a, w = torch.randn(2 * world + 1, 8), torch.randn(8, 4)
    try:
        torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, dist.group.WORLD.group_name, "sequential")
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_scatter_dim_that_does_not_split_is_refused_clearly():
    for message in run_distributed(_uneven_reduce_scatter, 2):
        assert "dim 0 of the product (5, 4) does not split into 2 equal blocks" in message, message
