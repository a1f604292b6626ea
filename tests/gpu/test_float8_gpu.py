"""Float8 (torch._scaled_mm) products through every GPU schedule on 2 GPUs vs their reference
twins and NCCL + _scaled_mm (see float8_cases)."""

from __future__ import annotations

import pytest
from float8_cases import run_float8_cases

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.gpu
def test_float8_schedules_match_reference_and_nccl(two_ranks):
    if two_ranks[1] != "nccl":
        pytest.skip("float8 _scaled_mm needs sm89+ on each rank's own GPU (two GPUs)")
    for results in run_distributed(run_float8_cases, two_ranks[0], backend=two_ranks[1], timeout_s=400):
        assert len(results) > 30
        bad = [f"{name}: error {err:.2e} vs reference {ref:.2e}" for name, err, ref in results
               if not within_tolerance(err, ref)]
        assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_compiled_float8_programs_run_gpu_schedules(two_ranks):
    # the CPU suite's float8 programs (tests/float8_programs.py) compiled with a GPU schedule:
    # the gathered float8 bytes, the scales and the bf16/fp32 products through ce_push on NCCL
    from float8_programs import run_float8_programs

    if two_ranks[1] != "nccl":
        pytest.skip("functional collectives over gloo on CUDA tensors crash in torch (two GPUs only)")
    kinds = {"ag_qk": "ag_matmul", "ag_bias": "ag_matmul", "rs": "matmul_rs", "ar": "matmul_ar"}
    for rank_results in run_distributed(run_float8_programs, 2, {"schedule": "ce_push", "chunks": 2},
                                        backend="nccl", timeout_s=400):
        for name, errors, regions, _ in rank_results:
            assert [r["kind"] for r in regions] == [kinds[name]], f"{name}: {regions}"
            for i, (compiled, eager) in enumerate(errors):
                assert within_tolerance(compiled, eager), f"{name} output {i}: commopt {compiled:.2e} vs eager {eager:.2e}"


@pytest.mark.gpu
def test_float8_calls_replay_from_cuda_graphs(two_ranks):
    # a captured float8 call replayed on new inputs and scales, and eager calls with cg=1
    from float8_cases import run_float8_replays

    if two_ranks[1] != "nccl":
        pytest.skip("float8 _scaled_mm needs sm89+ on each rank's own GPU (two GPUs)")
    for results, stats in run_distributed(run_float8_replays, two_ranks[0], backend=two_ranks[1], timeout_s=400):
        assert len(results) == 2 * 6 * 6
        assert sum(s["replayed"] for s in stats.values()) > 0, stats  # the cg calls did replay
        bad = [f"{name}: error {err:.2e} vs reference {ref:.2e}" for name, err, ref in results
               if not within_tolerance(err, ref)]
        assert not bad, "\n".join(bad)
