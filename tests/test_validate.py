"""validate.check_shape: a model the ranks cannot shard evenly is refused before it is built; the tolerance rule."""

from __future__ import annotations

import pytest

from torch_commopt.testing.validate import check_shape

BLOCK = {"batch": 2, "seq": 24, "dim": 36, "hidden": 72, "heads": 6}


def test_a_shape_that_splits_is_accepted():
    for world in (2, 3, 6):
        check_shape("tp_sp_block", BLOCK, world)
    check_shape("funcol_mlp", {**BLOCK, "seq": 5, "batch": 6}, 3)  # rows 30: split by 3


@pytest.mark.parametrize("kind, shape, world, named", [
    ("tp_sp_block", {**BLOCK, "hidden": 64}, 3, "hidden 64 over 3 ranks"),
    ("tp_sp_block", {**BLOCK, "heads": 4}, 3, "heads 4 over 3 ranks"),
    ("tp_sp_block", {**BLOCK, "dim": 40}, 2, "dim 40 over 6 heads"),
    ("tp_sp_mlp", {**BLOCK, "seq": 7}, 2, "seq 7 over 2 ranks"),
    ("tp_sp_block", {**BLOCK, "kv_heads": 2}, 3, "kv heads 2 over 3 ranks"),
    ("funcol_mlp", {**BLOCK, "seq": 5, "batch": 1}, 2, "batch x seq 5 over 2 ranks"),
])
def test_a_shape_that_does_not_split_is_refused_by_name(kind, shape, world, named):
    with pytest.raises(ValueError, match=named):
        check_shape(kind, shape, world)


def test_tp_block_does_not_shard_the_sequence():
    check_shape("tp_block", {**BLOCK, "seq": 7}, 3)


def test_tolerance_refuses_a_reference_that_is_not_the_same_computation():
    from torch_commopt.testing.validate import within_tolerance

    assert within_tolerance(3e-3, 1e-3) and not within_tolerance(5e-3, 1e-3)
    assert within_tolerance(1e-9, 0.0)  # rounding noise
    # eager far from float64 (other weights, other inputs): "as close as eager" proves nothing
    assert not within_tolerance(1.37, 1.37)
