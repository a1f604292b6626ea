"""The reference schedules and the compiled path on NCCL (2 GPUs)."""

from __future__ import annotations

import pytest
from dist_programs import run_funcol_programs, run_models
from reference_programs import run_reference_cases

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance

SCHEDULES = [{"schedule": "sequential"}, {"schedule": "chunked", "chunks": 3}]


def _ok(label, c, e):
    assert within_tolerance(c, e), f"{label}: commopt error {c:.2e} vs eager {e:.2e}"


@pytest.mark.gpu
def test_reference_ops_on_nccl(two_gpus):
    for results, fake_mismatch in run_distributed(run_reference_cases, two_gpus, backend="nccl"):
        assert not fake_mismatch
        for name, err, ref_err in results:
            _ok(name, err, ref_err)


@pytest.mark.gpu
@pytest.mark.parametrize("options", SCHEDULES, ids=lambda o: o["schedule"])
def test_compiled_patterns_and_models_on_nccl(two_gpus, options):
    for rank_results in run_distributed(run_funcol_programs, two_gpus, options, backend="nccl"):
        for name, errors, ops, expected_op in rank_results:
            assert ops.get(expected_op, 0) >= 1, name
            for i, (c, e) in enumerate(errors):
                _ok(f"{name}[{i}]", c, e)
    kinds = ("funcol_mlp", "tp_sp_mlp", "tp_sp_block")
    for rank_results in run_distributed(run_models, two_gpus, options, kinds, backend="nccl"):
        for kind, (errors, rewritten) in rank_results.items():
            assert rewritten >= 3, kind
            for name, c, e in errors:
                _ok(f"{kind} {name}", c, e)
