"""CoCoNet's all-gather reorder: moved after row-wise ops, exact, and the gather meets its matmul."""

from __future__ import annotations

from coconet_programs import reorder_fwd_bwd

from torch_commopt.testing.launch import run_distributed


def test_all_gather_moves_after_row_wise_ops_and_stays_exact():
    for notes, kinds, fwd, grads in run_distributed(reorder_fwd_bwd, 2, timeout_s=300):
        moved = [n for n in notes if "all-gather moved after" in n]
        assert len(moved) == 1 and moved[0].count("relu") == 1 and "convert" not in moved[0], notes
        assert "ag_matmul" in kinds, kinds  # the gather now feeds the matmul directly
        assert fwd < 1e-5 and max(grads) < 1e-5, (fwd, grads)


def test_a_tp_sp_block_with_coconet_on_matches_eager_and_has_nothing_to_reorder():
    """In a TP+SP block every all-gather feeds its matmuls directly (the norm runs before the
    gather, on the shard): the reorder finds nothing to move; all eight regions (four per
    pass, the backward's two through concat-K) are rewritten and the block matches eager."""
    from coconet_programs import tp_sp_block_with_coconet

    from torch_commopt.testing.validate import within_tolerance

    for moved, kinds, errors in run_distributed(tp_sp_block_with_coconet, 2, "float32", timeout_s=600):
        assert moved == [], moved
        assert sorted(kinds) == ["ag_matmul"] * 4 + ["matmul_rs"] * 4, kinds
        for name, c, e in errors:
            assert within_tolerance(c, e), f"{name}: commopt error {c:.2e} vs eager {e:.2e}"
