"""compiled-with-commopt vs eager on real gloo groups (2, 3 and 4 ranks), forward and backward,
for both reference schedules.  Tolerance: a few times eager float32's own error against
a float64 run of the same program."""

from __future__ import annotations

import pytest
from dist_programs import run_funcol_programs, run_models

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance

SCHEDULES = [{"schedule": "sequential"}, {"schedule": "chunked", "chunks": 3}]
# the overlapped schedule at 2 and 4 ranks; `sequential` (the program's own collective + matmul
# through our op) runs the whole TP+SP block, forward and backward, in tests/passes/test_regather.py
CASES = [(2, SCHEDULES[1]), pytest.param(4, SCHEDULES[1], marks=pytest.mark.slow)]
# the models at an odd world only: world 2 runs them in the demo, the regather, dynamic-shape and
# checkpointing tests, world 4 in the (dp, tp) mesh test
IDS = lambda x: f"world{x}" if isinstance(x, int) else x["schedule"]  # noqa: E731


def _assert_close(label, compiled, eager):
    assert within_tolerance(compiled, eager), f"{label}: commopt error {compiled:.2e} vs eager {eager:.2e}"


@pytest.mark.parametrize("world, options", CASES, ids=IDS)
def test_funcol_patterns_match_eager(world, options):
    for rank_results in run_distributed(run_funcol_programs, world, options):
        for name, errors, ops, expected_op in rank_results:
            assert ops.get(expected_op, 0) >= 1, f"{name}: {expected_op} not rewritten ({ops})"
            for i, (c, e) in enumerate(errors):
                _assert_close(f"{name} output {i}", c, e)


@pytest.mark.parametrize("world, options", [(3, SCHEDULES[1])], ids=IDS)
def test_models_forward_backward_match_eager(world, options):
    # world 3: an odd world (blocks of 36 / 72 features, 6 heads), the overlapped schedule; four
    # ranks run the funcol patterns above and the (dp, tp) mesh (tests/test_mesh_2d.py); tp_sp_block
    # holds tp_sp_mlp's MLP
    kinds = ("funcol_mlp", "tp_sp_block")
    for rank_results in run_distributed(run_models, world, options, kinds):
        for kind, (errors, rewritten) in rank_results.items():
            assert rewritten >= 3, f"{kind}: only {rewritten} regions rewritten"
            for name, c, e in errors:
                _assert_close(f"{kind} {name}", c, e)


def test_gqa_block_matches_eager():
    # Llama-3's attention: 8 query heads over 2 key/value heads (wk, wv narrower than wq)
    shape = {"batch": 2, "seq": 16, "dim": 64, "hidden": 128, "heads": 8, "kv_heads": 2}
    for rank_results in run_distributed(run_models, 2, SCHEDULES[1], ("tp_sp_block",), shape):
        errors, rewritten = rank_results["tp_sp_block"]
        assert rewritten >= 6, f"only {rewritten} regions rewritten"
        for name, c, e in errors:
            _assert_close(f"gqa block {name}", c, e)


def test_gpu_schedules_run_their_reference_twin_on_cpu():
    """A graph rewritten with a GPU schedule stays portable: on gloo the ops run the twin."""
    options = {"schedule": "ce_push", "chunks": 3}
    for rank_results in run_distributed(run_funcol_programs, 2, options):
        for name, errors, ops, expected_op in rank_results:
            assert ops.get(expected_op, 0) >= 1, f"{name}: {expected_op} not rewritten ({ops})"
            for i, (c, e) in enumerate(errors):
                _assert_close(f"{name} output {i}", c, e)
