"""The all-reduce split analysis (passes/ar_split.py) on graphs of a fake process group:
which ops count as row-local, which operands must be sliced or used as they are."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt

pytestmark = pytest.mark.parametrize("fake_world", [2, 4], indirect=True)


def _notes(fn, *inputs):
    torch_commopt.reset_explain()
    torch.compile(fn, backend="commopt", options={"patterns": ()})(*inputs)
    return [n for g in torch_commopt.explain().graphs for n in g.notes if n.startswith("split candidate")]


def _all_reduce(t):
    return funcol.all_reduce(t, "sum", group=dist.group.WORLD.group_name)


def _rmsnorm(h, g):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def test_tp_block_residual_and_norm_are_a_candidate_that_pays(fake_world):
    # row-parallel output -> all-reduce -> residual add -> RMSNorm -> column-parallel matmul
    x, a, wo, g, w1 = (torch.randn(16, 32), torch.randn(16, 8), torch.randn(8, 32), torch.randn(32),
                       torch.randn(32, 8))

    def fn(x, a, wo, g, w1):
        h = x + _all_reduce(a @ wo)
        return h, _rmsnorm(h, g) @ w1

    (note,) = _notes(fn, x, a, wo, g, w1)
    assert "16 rows" in note and "worth it" in note
    assert "1 full and 1 broadcast operand(s)" in note  # x sliced to the rank's rows, g as is
    assert "all-gather of 2 value(s)" in note  # h (an output) and the normalized rows (to the matmul)


def test_no_matmul_after_it_is_reported_as_not_worth_it(fake_world):
    a, w = torch.randn(8, 16), torch.randn(16, 16)

    def fn(a, w):
        return torch.relu(_all_reduce(a @ w)) * 2.0

    (note,) = _notes(fn, a, w)
    assert "no GEMM to overlap on both sides" in note


def test_ops_that_are_not_row_local_end_the_candidate(fake_world):
    a, w = torch.randn(8, 16), torch.randn(16, 16)

    def column_sum(a, w):  # a reduction over dim 0 mixes rows
        return _all_reduce(a @ w).sum(0)

    def transpose(a, w):
        return _all_reduce(a @ w).t() @ a

    def row_vector_broadcast(a, w):  # a per-row value broadcast along columns: not row-local
        t = _all_reduce(a @ w)
        return t * t.mean(-1)

    assert _notes(column_sum, a, w) == []
    assert _notes(transpose, a, w) == []
    (note,) = _notes(row_vector_broadcast, torch.randn(16, 16), w)  # square: [16] broadcasts along columns
    assert "-> 1 row-local op(s)" in note  # the mean only; the broadcasting mul is outside


def test_rows_that_do_not_split_are_not_a_candidate(fake_world):
    a, w = torch.randn(fake_world + 1, 16), torch.randn(16, 16)
    assert _notes(lambda a, w: torch.relu(_all_reduce(a @ w)), a, w) == []
