"""Every reference schedule against plain torch on full tensors, on gloo with 2 and 4 ranks:
gather/scatter dims 0/1/2, K gathered, N scattered, bmm weights, bias, sum/avg, chunk counts
that do not divide the rows or exceed them; and the fake impls give the real shapes."""

from __future__ import annotations

import pytest
import torch
from reference_programs import run_rank_order_sums, run_reference_cases

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), 4])
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


def _mismatched_k_parts(rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    import torch_commopt  # noqa: F401  (registers the ops)

    a, w, group = torch.randn(2 * world, 8), torch.randn(8, 4), dist.group.WORLD.group_name
    messages = []
    for more_a, more_w in [([torch.randn(2 * world, 3)], []),  # unpaired
                           ([torch.randn(2 * world, 3)], [torch.randn(3, 5)]),  # another N
                           ([torch.randn(2 * world + 2, 3)], [torch.randn(3, 4)]),  # other rows
                           ([torch.randn(2 * world, 3, dtype=torch.float64)], [torch.randn(3, 4)])]:  # dtype
        try:
            torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", world, group, "chunked:2", more_a=more_a, more_w=more_w)
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_k_parts_that_do_not_fit_are_refused_clearly():
    for messages in run_distributed(_mismatched_k_parts, 2):
        assert "1 more_a for 0 more_w" in messages[0], messages
        for m in messages[1:3]:
            assert "does not match a (4, 8) @ weight (8, 4) (same rows, same N)" in m, messages
        assert "dtypes / devices differ" in messages[3], messages


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_order_sums_give_every_rank_the_same_bits(world):
    # the one-shot / two-shot all-reduces' references: the same bits on every rank and from both
    # schedules (fp32 sums in rank order, one cast), as close to float64 as plain all-reduce
    per_rank = run_distributed(run_rank_order_sums, world)
    bits0 = dict(per_rank[0][0])
    for bits, errors in per_rank:
        assert dict(bits) == bits0
        for name, err, ref_err in errors:
            assert within_tolerance(err, ref_err), f"{name}: error {err:.2e} vs plain all-reduce {ref_err:.2e}"
    by_case: dict[str, set] = {}
    for name, value in bits0.items():
        by_case.setdefault(name.rsplit(" ", 1)[0], set()).add(str(value))
    assert all(len(v) == 1 for v in by_case.values()), "gather_sum and scatter_gather differ"


def test_the_lean_sequential_path_covers_every_dim_but_the_contracted_one():
    """A sequence-parallel (B, S, K) activation gathered or scattered along S takes the lean path
    (process-group calls, one copy into place), which run_reference_cases checks against plain
    torch; the contracted dim, 3-D weights and uneven splits take the reference path."""
    from torch_commopt.kernels.matmul import sequential

    a, w = torch.zeros(2, 6, 16), torch.zeros(16, 8)
    assert sequential.applies(a, [w], 1, 2, cut=True) and sequential.applies(a, [w], -2, 3, cut=True)
    assert sequential.applies(a, [w], 0, 2, cut=True) and sequential.applies(a, [w], None, 2, cut=False)
    assert not sequential.applies(a, [w], 2, 2, cut=False)  # K
    assert not sequential.applies(a, [w], 1, 4, cut=True)  # 6 rows in 4
    assert not sequential.applies(a, [torch.zeros(2, 16, 8)], 1, 2, cut=False)
    assert not sequential.applies(a.transpose(0, 1), [w], 1, 2, cut=False)
