"""The host-side checks that decide whether the fused kernels take their operands by TMA
(kernels/matmul/gpu/tma.py): what they refuse, and that a refusal is logged once per op and reason
(the pointer-load kernel then runs).  CPU tensors: the checks read shapes, strides and
addresses only."""

from __future__ import annotations

import logging

import torch

from torch_commopt.kernels.matmul.gpu import tma


def _operands(m=256, k=128, n=256):
    a = torch.randn(m, k, dtype=torch.bfloat16)
    return a, torch.randn(n, k, dtype=torch.bfloat16).t()  # nn.Linear's weight, transposed: K-major


def test_aligned_kmajor_operands_are_taken():
    a, w = _operands()
    assert tma.refusal([a], [w], 128, 128, 64) is None
    assert tma.b_views([w])[1] is True and tma.b_views([w.contiguous()])[1] is False


def test_refusals_name_the_reason():
    a, w = _operands()
    assert "neither" in tma.refusal([a], [w, w.contiguous()], 128, 128, 64)
    odd = torch.randn(256, 129, dtype=torch.bfloat16)[:, 1:]  # row pitch 258 bytes
    assert "aligned" in tma.refusal([odd], [w], 128, 128, 64)
    assert "smaller than one tile" in tma.refusal([a[:100]], [w], 128, 128, 64)


def test_a_refusal_is_logged_once_per_op_and_reason(caplog):
    a, w = _operands()
    tma._logged.clear()
    with caplog.at_level(logging.INFO, logger=tma.log.name):
        for _ in range(3):
            assert tma.descriptors("matmul_rs", [a[:100]], [w], 128, 128, 64) is None
        assert tma.descriptors("matmul_rs", [a], [w], 128, 128, 64, why_not="rows span two runs") is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("pointer-load kernel" in m for m in messages)


def test_the_all_gather_flattens_only_tiles_of_at_least_twice_its_stages_in_k_steps():
    """flat=1 flattens where a tile's k steps leave its lookahead flag wait ahead of the next
    tile's loads (a step's loads up to stages - 1 steps early, the wait up to as many late)."""
    p = {"flat": 1, "bk": 64, "stages": 3}
    assert tma.flat_ok(p, 6 * 64) and tma.flat_ok(p, 4096)
    assert not tma.flat_ok(p, 5 * 64) and tma.flat_ok(p, 5 * 64 + 1)  # a partial last step counts
    assert not tma.flat_ok({**p, "stages": 4}, 7 * 64) and tma.flat_ok({**p, "stages": 4}, 8 * 64)
    assert not tma.flat_ok({**p, "flat": 0}, 4096) and not tma.flat_ok({"bk": 64, "stages": 3}, 4096)
