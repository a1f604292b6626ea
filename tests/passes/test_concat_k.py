"""Concat-K: a sum of matmuls feeding a reduction becomes one matmul, exactly, and only there."""

from __future__ import annotations

import pytest
from concat_k_programs import CHUNKED, KEPT, PROGRAMS, block_regions_each, graph_cases

from torch_commopt.passes.matmul.concat_k import parts_cheaper
from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


def test_sums_of_matmuls_before_a_reduction_fold_into_one_exact_matmul():
    for per_rank in run_distributed(graph_cases, 2, timeout_s=300):
        for name, (folded, mms, err, undone, left, err_undone) in per_rank.items():
            want = PROGRAMS[name][1]
            if want:
                assert folded == [want] and mms == 1, (name, folded, mms)
            else:
                assert folded == [] and mms >= 1, (name, folded, mms)  # left as traced
            assert err < 1e-10, (name, err)  # float64: the same sum, another order
            # undo_unclaimed restores the traced program: its matmuls, no cat, its order of sums
            assert undone == len(folded) and left == (0, 0), (name, undone, left)
            assert err_undone == 0.0, (name, err_undone)


def test_tp_sp_block_backward_reductions_become_regions_and_match_eager():
    configs = [(True, {**CHUNKED, "k_parts": False}), (False, CHUNKED), (True, {**CHUNKED, "k_parts": True})]
    for (bwd, notes, cats, errors), (bwd0, notes0, cats0, _), (bwd_p, _, cats_p, errors_p) in run_distributed(
            block_regions_each, 2, configs, timeout_s=600):
        # dX = dq Wq + dk Wk + dv Wv and d1 W1 + d3 W3: two more reduce-scatter regions
        assert bwd.count("matmul_rs") == bwd_p.count("matmul_rs") == bwd0.count("matmul_rs") + 2, (bwd, bwd0)
        # as K parts (Config.k_parts) the ops take the terms: no cat of the operands or of the
        # weights is left (fewer cats than without: there the sums stay, each with its
        # reduce-scatter's split/cat); the concatenated form keeps its cats
        assert cats_p <= cats0 < cats, (cats_p, cats0, cats)
        for name, c, e in errors_p:
            assert within_tolerance(c, e), f"K parts, {name}: commopt error {c:.2e} vs eager {e:.2e}"
        assert len(notes) == 2 and notes0 == [], (notes, notes0)
        assert any("sum of 3 matmuls" in n for n in notes) and any("sum of 2 matmuls" in n for n in notes), notes
        for name, c, e in errors:
            assert within_tolerance(c, e), f"{name}: commopt error {c:.2e} vs eager {e:.2e}"


@pytest.mark.slow
def test_k_parts_auto_splits_the_w1_w3_sum_and_keeps_the_q_k_v_cats():
    # 128 rows, dim 32, float32, per rank q/k/v K 16 + 16 + 16 (its operands copied into the cat
    # here) and w1/w3 K 128 + 128.  q/k/v: two more passes over the 128 x 32 product (64 KiB)
    # against its cats twice over (6 KiB of weights + 24 KiB of operands: 60 KiB): cats kept.
    # w1/w3: one more pass (32 KiB) against its 32 KiB weight stack twice over (64 KiB): parts.
    shape = {"batch": 8, "seq": 16, "dim": 32, "hidden": 256, "heads": 4}
    configs = [(True, {**CHUNKED, "k_parts": k}, shape) for k in (False, True, "auto")]
    for (_, _, cats, _), (_, _, cats_p, _), (bwd_a, _, cats_a, errors_a) in run_distributed(
            block_regions_each, 2, configs, timeout_s=600):
        assert cats_p < cats_a < cats, (cats_p, cats_a, cats)
        assert bwd_a.count("matmul_rs") >= 2, bwd_a
        for name, c, e in errors_a:
            assert within_tolerance(c, e), f"{name}: commopt error {c:.2e} vs eager {e:.2e}"


@pytest.mark.slow
def test_kept_regions_get_their_sum_of_matmuls_back():
    for (bwd, notes, cats, errors), (bwd0, _, cats0, _) in run_distributed(block_regions_each, 2,
                                                                           [(True, KEPT), (False, KEPT)], timeout_s=600):
        assert bwd == bwd0 == [], (bwd, bwd0)  # every region kept as compiled
        folded = [n for n in notes if "matmuls (K =" in n]
        undone = [n for n in notes if "concat-K undone" in n]
        assert len(folded) == 2 and len(undone) == 2, notes
        assert cats == cats0, (cats, cats0)  # no copy of A or of the weights is left behind
        for name, c, e in errors:
            assert within_tolerance(c, e), f"{name}: commopt error {c:.2e} vs eager {e:.2e}"


def test_operands_other_readers_take_slices_so_pointwise_operands_are_not_copied():
    from concat_k_programs import shared_readers

    for err, slices, (charged, expect), readers, (err_undone, left), (kept, kept_expect) in run_distributed(
            shared_readers, 2, timeout_s=300):
        assert err < 1e-10 and err_undone < 1e-10, (err, err_undone)
        # d1 and d2 (pointwise, read by transposes that feed matmuls) are shared; d3's reader is
        # a reshape of the whole tensor (no strided view) and a1 is an input that is read raw
        assert slices == 2 and readers == ["t.default", "t.default"], (slices, readers)
        assert charged == expect, (charged, expect)
        assert left == 0
        assert kept == kept_expect


def test_k_parts_auto_takes_the_parts_where_they_move_fewer_bytes():
    # Llama-3-8B, TP=2, 8192 rows, bf16: dX = d1 W1 + d3 W3 (stacked weights 14336 x 4096)
    # against dX = dq Wq + dk Wk + dv Wv (3072 x 4096, no operand copied: attention's clone
    # writes them in place)
    rows, dim, bf16 = 8192, 4096, 2
    assert parts_cheaper(rows, dim, bf16, 2, 14336 * dim * bf16)
    assert not parts_cheaper(rows, dim, bf16, 3, 3072 * dim * bf16)
    # an operand copied into the cat counts for the cats: one of 8192 x 14336 tips q/k/v over
    assert parts_cheaper(rows, dim, bf16, 3, 3072 * dim * bf16 + rows * 14336 * bf16)
    # decode: a few rows, any weights
    assert parts_cheaper(4, dim, bf16, 3, 3072 * dim * bf16)
    # one term is no sum at all: never "parts"
    assert not parts_cheaper(rows, dim, bf16, 1, 0)
