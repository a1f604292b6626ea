"""Expert-parallel schedules (kernels/moe) on GPUs: the same cases as on gloo
(tests/kernels/moe_cases.py), float64 against one process on the CPU running every expert over
every rank's tokens.  With NCCL, by_peer's posted transfers run on NCCL's stream under the experts."""

from __future__ import annotations

import pytest
from moe_cases import (
    CASES,
    run_bf16,
    run_module_graphed,
    run_schedules,
    run_sync_free_graphed,
    run_sync_free_unsynced,
)

from torch_commopt.core import env
from torch_commopt.testing.launch import run_distributed


@pytest.mark.gpu
def test_every_schedule_matches_one_process_on_gpus(two_ranks):
    world, backend = two_ranks
    for results in run_distributed(run_schedules, world, ("balanced", "skewed"), "cuda", backend=backend,
                                   timeout_s=300):
        assert len(results) == 2 * len(CASES)
        bad = [(case, err) for case, err in results if not err <= 1e-12]
        assert not bad, bad


@pytest.mark.gpu
def test_by_expert_in_bf16_is_as_close_as_the_grouped_gemm_reference(two_ranks):
    # by_expert's and sync_free's own grouped GEMMs and hand-written SwiGLU backward, against
    # float64 on the CPU, no further off than torchtitan's way (a2a with bf16 grouped GEMMs) is
    world, backend = two_ranks
    for results in run_distributed(run_bf16, world, backend=backend, timeout_s=300):
        assert len(results) == 2
        # by the copy engine (ce_exchange) unless turned off: forward and backward, each routing
        if env.moe_transport() == "ce":
            assert results[-1][0].endswith("ce passes 4"), results
        bad = [(case, mine, ref, free) for case, mine, ref, free in results
               if not (ref < 0.05 and max(mine, free) <= 1.5 * ref + 1e-3)]
        assert not bad, bad


@pytest.mark.gpu
def test_sync_free_reads_nothing_on_the_host_after_its_first_call(two_ranks):
    # the whole call, forward and backward, under torch.cuda.set_sync_debug_mode("error"); NCCL
    # only (gloo stages CUDA tensors through host memory, a sync by design)
    world, backend = two_ranks
    if backend != "nccl":
        pytest.skip("gloo stages CUDA tensors through the host")
    for got in run_distributed(run_sync_free_unsynced, world, backend=backend, timeout_s=300):
        assert got["error"] == "" and got["rel"] < 0.02, got


@pytest.mark.gpu
def test_by_expert_on_nccl_with_one_rank(one_gpu):
    # NCCL's all_to_all of views (by_expert's transfers there), on a one-rank group: what one GPU
    # can run of it; two GPUs run the test above on NCCL
    for results in run_distributed(run_bf16, 1, ("balanced",), backend="nccl", timeout_s=300):
        assert len(results) == 1
        bad = [(case, mine, ref, free) for case, mine, ref, free in results
               if not (ref < 0.05 and max(mine, free) <= 1.5 * ref + 1e-3)]
        assert not bad, bad


@pytest.mark.gpu
def test_sync_free_reads_nothing_on_the_host_on_a_one_rank_nccl_group(one_gpu):
    # what one GPU can check of the above: the same calls over NCCL on a one-rank group
    for got in run_distributed(run_sync_free_unsynced, 1, backend="nccl", timeout_s=300):
        assert got["error"] == "" and got["rel"] < 0.02, got


@pytest.mark.gpu
def test_sync_free_runs_captured_in_a_cuda_graph_on_new_routings(one_gpu):
    # the forward captured once over NCCL (a one-rank group: what one GPU runs), replayed on new
    # tokens and counts copied into its inputs: the eager call's bits each time
    for got in run_distributed(run_sync_free_graphed, 1, backend="nccl", timeout_s=300):
        assert got["same"] and got["rel"] < 0.02, got


@pytest.mark.gpu
def test_an_a2a_module_captured_in_a_cuda_graph_runs_sync_free(one_gpu):
    # a module installed with a2a, warmed up eagerly, captured: sync_free inside the capture
    for got in run_distributed(run_module_graphed, 1, backend="nccl", timeout_s=300):
        assert got["last"] == "sync_free" and got["rel"] < 0.02, got


@pytest.mark.gpu
def test_compiled_fixed_capacity_moe_in_chunks_is_as_close_as_kept(two_ranks):
    # passes/moe: the forward's and the backward's exchange pairs run in two chunks of experts on
    # the graph's NCCL collectives, no further from float64 than the same layer with them kept
    from capacity_cases import capacity_bf16

    world, backend = two_ranks
    if backend != "nccl":
        pytest.skip("a compiled program's functional collectives on CUDA tensors need NCCL: two GPUs")
    for notes, chunked, kept in run_distributed(capacity_bf16, world, backend=backend, timeout_s=300):
        assert sum("rewritten, by_expert:2" in n for n in notes) == 2, notes
        assert kept < 0.05 and chunked <= 1.5 * kept + 1e-3, (chunked, kept)


@pytest.mark.gpu
def test_the_padded_gather_kernel_gives_the_rows_the_cpu_gives(one_gpu):
    """runs.gather_padded's Triton kernel (the MoE gathers and their backwards) against its CPU
    path: fresh random rows, empty slots (zero rows), and a flagged call (every row NaN)."""
    import torch

    from torch_commopt.kernels.moe.runs import gather_padded

    gen = torch.Generator().manual_seed(21)
    for rows, width, dtype in ((5000, 2048, torch.bfloat16), (777, 1000, torch.float32)):
        src = torch.randn(rows, width, generator=gen).to(dtype)
        index = torch.randint(0, rows + rows // 5, (rows + 333,), generator=gen).clamp(max=rows)
        for flag in (None, torch.tensor(False), torch.tensor(True)):
            want = gather_padded(src, index, flag, float("nan"))
            got = gather_padded(src.cuda(), index.cuda(), flag.cuda() if flag is not None else None, float("nan"))
            assert torch.equal(got.cpu().nan_to_num(), want.nan_to_num()), (rows, width, flag)
            assert torch.equal(got.isnan().cpu(), want.isnan()), (rows, width, flag)
