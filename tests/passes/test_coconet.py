"""CoCoNet's all-gather reorder: moved after row-wise ops, exact, and the gather meets its matmul."""

from __future__ import annotations

from coconet_programs import reorder_fwd_bwd
from torch_commopt.launch import run_distributed


def test_all_gather_moves_after_row_wise_ops_and_stays_exact():
    for notes, kinds, fwd, grads in run_distributed(reorder_fwd_bwd, 2, timeout_s=300):
        moved = [n for n in notes if "all-gather moved after" in n]
        assert len(moved) == 1 and moved[0].count("relu") == 1 and "convert" not in moved[0], notes
        assert "ag_matmul" in kinds, kinds  # the gather now feeds the matmul directly
        assert fwd < 1e-5 and max(grads) < 1e-5, (fwd, grads)
