"""Fixed-capacity MoE in compiled graphs (passes/moe): the dispatch / experts / combine triple
found in the forward and backward graphs and run in chunks of local experts, exact against
eager on gloo; what is not such a triple is left alone with its reason."""

from __future__ import annotations

import pytest
from capacity_moe_programs import capacity_moe_fwd_bwd

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world, schedule, chunks", [(2, "by_expert:2", 2),
                                                     pytest.param(2, "by_expert:3", 3, marks=pytest.mark.slow),
                                                     pytest.param(4, "by_expert:2", 2, marks=pytest.mark.slow)])
def test_chunked_exchanges_match_eager_forward_and_backward(world, schedule, chunks):
    # 8 experts: 4 local at 2 ranks (chunks of 1-2 experts), 2 local at 4 ranks
    for notes, counts, out_err, grad_errs in run_distributed(capacity_moe_fwd_bwd, world, schedule, timeout_s=400):
        rewritten = [n for n in notes if n.startswith("moe ") and "rewritten" in n]
        assert len(rewritten) == 2, notes  # the forward's triple and the backward's
        used = min(chunks, 8 // world)
        assert all(f"by_expert:{used}" in n for n in rewritten), rewritten
        # every exchange became one per chunk, in both graphs
        assert sorted(c for c in counts if c[1]) == sorted((k, 2, 2 * used) for k, _, _ in counts if _), counts
        assert out_err < 1e-12 and max(grad_errs) < 1e-12, (out_err, grad_errs)


@pytest.mark.slow
def test_a2a_keeps_the_exchanges_and_says_so():
    for notes, counts, out_err, grad_errs in run_distributed(capacity_moe_fwd_bwd, 2, "a2a", timeout_s=300):
        kept = [n for n in notes if n.startswith("moe ") and "kept" in n]
        assert len(kept) == 2 and all("Config.moe_schedule a2a" in n for n in kept), notes
        assert all(before == after for _, before, after in counts), counts
        assert out_err < 1e-12 and max(grad_errs) < 1e-12


def test_auto_picks_the_same_on_every_rank_and_stays_exact():
    results = run_distributed(capacity_moe_fwd_bwd, 2, "auto", timeout_s=300)
    picks = [sorted(n for n in notes if n.startswith("moe ")) for notes, _, _, _ in results]
    assert picks[0] and picks[0] == picks[1], picks  # one decision, from rank 0's estimate
    assert all("auto:" in n for n in picks[0]), picks
    assert all(e < 1e-12 and max(g) < 1e-12 for _, _, e, g in results)


def test_a_middle_that_mixes_the_experts_is_left_alone_with_its_reason():
    from capacity_moe_programs import mixing_left_alone

    for reasons, err in run_distributed(mixing_left_alone, 2, timeout_s=300):
        assert any("contracts over the experts' axis" in r or "loses the experts' axis" in r for r in reasons), reasons
        assert err < 1e-12
