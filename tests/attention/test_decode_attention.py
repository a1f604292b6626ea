"""The distributed decoding attention's reference (kernels/attention/decode.py) on gloo at 2 and 4
ranks, float64: one and three queries, GQA, no mask, a prefix mask that leaves the later ranks'
shares fully masked for some rows, an additive mask; against attention over the whole cache, and
the same result on every rank."""

from __future__ import annotations

import pytest
from decode_programs import run_decode

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world", [2, 4])
def test_partial_attentions_merged_by_lse_equal_attention_over_the_whole_cache(world):
    per_rank = run_distributed(run_decode, world, backend="gloo", timeout_s=300)
    assert len(per_rank[0]) == 6
    for results in per_rank:
        for (case, err, got), (_, _, got0) in zip(results, per_rank[0]):
            assert err <= 1e-12, (case, err)
            assert got == got0, f"{case}: ranks differ"


def test_a_local_share_with_every_key_masked_gives_an_empty_partial():
    import torch

    from torch_commopt.kernels.attention.decode import local_partial

    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 5)
    out, lse = local_partial(q, k, v, torch.zeros(1, 1, 1, 3, dtype=torch.bool), 0.5)
    assert torch.isneginf(lse).all() and not out.any()
