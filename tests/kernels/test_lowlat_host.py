"""The one-shot all-reduce's host side (kernels/matmul/gpu/lowlat_ar.py, kernels/gpu/lowlat.py) on
the CPU: which calls it refuses and why, and the grid every rank computes alike."""

from __future__ import annotations

import torch

from torch_commopt.kernels.gpu import lowlat, symm
from torch_commopt.kernels.matmul.gpu.lowlat_ar import refusal


def test_decode_sized_calls_run_and_the_rest_is_refused_with_the_reason():
    a, w = torch.zeros(8, 4096, dtype=torch.bfloat16), torch.zeros(4096, 4096, dtype=torch.bfloat16)
    assert refusal(a, w, 2, "g", False, None) is None
    assert refusal(a[:1], w, 8, "g", False, None) is None  # one row: no split over ranks needed
    big = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    assert "exceeds the 16 MiB low-latency buffer" in refusal(big, w, 2, "g", False, None)
    assert "batched" in refusal(a, torch.zeros(2, 4096, 8, dtype=torch.bfloat16), 2, "g", False, None)
    assert "one dtype" in refusal(a, w.float(), 2, "g", False, None)
    assert "float8" in refusal(a, w, 2, "g", False, object())
    assert "more than 64 ranks" in refusal(a, w, symm.MAX_WORLD + 1, "g", False, None)


def test_the_grid_follows_the_message_only():
    assert lowlat.blocks_for(1) == 1 and lowlat.blocks_for(lowlat.MIN_BLOCK + 1) == 2
    assert lowlat.blocks_for(10**9) == symm.LL_BLOCKS
    # the block grows with the message so that the grid covers it in one step, up to MAX_BLOCK
    assert lowlat.block_for(1) == lowlat.MIN_BLOCK and lowlat.block_for(10**9) == lowlat.MAX_BLOCK
    assert lowlat.block_for(symm.LL_BLOCKS * 2048) == 2048 and lowlat.block_for(symm.LL_BLOCKS * 2048 + 1) == 4096


def test_a_segment_of_the_two_shot_lies_on_16_bytes():
    assert lowlat.segment(1, 2, 2) == 8 and lowlat.segment(17, 2, 2) == 16 and lowlat.segment(17, 3, 4) == 8
    assert all(lowlat.segment(n, w, 2) * w >= n for n in (1, 7, 1000, 4097) for w in (2, 3, 4))
