"""The 2D GEMM regions (passes/matmul/gemm_2d.py, kernels/mesh2d/ops.py) on GPUs: four ranks as a
2 x 2 mesh (four GPUs with NCCL, or one GPU shared by four ranks over gloo with
TORCH_COMMOPT_SHARED_DEVICE=1), X @ W and F.linear, the model's S and S = 2, forward and backward
in bf16 within the tolerance of eager DTensor's own error (mesh2d_cases)."""

from __future__ import annotations

import pytest
from mesh2d_cases import run_gemm_2d, run_ops_2d

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("linear", [False, True], ids=["matmul_os", "linear_rs"])
def test_a_2d_gemm_region_matches_float64_within_eagers_own_error(four_ranks, linear):
    world, backend = four_ranks
    if backend == "gloo":
        # DTensor's programs (the eager reference and the compiled one alike: the loss's reduction
        # stays a functional collective) run their collectives on CUDA tensors, which crash gloo:
        # four ranks sharing one H200 all died with SIGSEGV in _c10d_functional.all_gather_into_tensor's
        # wait (docs/meshslice.md).  The 2 x 2 mesh needs four GPUs; the same programs run on gloo
        # with CPU tensors in the CPU suite.
        pytest.skip("a DTensor program's collectives on CUDA tensors need NCCL: four GPUs")
    dataflow = "rs" if linear else "os"
    for rank, runs in enumerate(run_distributed(run_gemm_2d, world, linear, (None, 2), backend=backend,
                                                timeout_s=500)):
        for s, got, eager, regions in runs:
            kinds = dict(regions)
            assert "gemm_2d" in kinds, (rank, s, regions)
            if s == 2:
                assert kinds["gemm_2d"] == f"meshslice:{dataflow}:S=2", (rank, regions)
            bad = [(name, g, e) for name, g, e in zip(("loss", "dX", "dW"), got, eager, strict=True)
                   if not within_tolerance(g, e)]
            assert not bad, (rank, s, bad)


@pytest.mark.gpu
def test_the_2d_gemm_op_matches_float64_within_one_gpus_own_error(four_ranks):
    """commopt's gemm_2d on bf16 CUDA blocks, every dataflow, MeshSlice's S = 2 and 4 and the
    Collective 2D GEMM (S = 1), called directly: where four ranks share one GPU (gloo, whose
    collectives the reference kernels stage through host memory) this is the GPU check of the
    2D GEMMs' numerics that DTensor's programs cannot run (the test above).  ls and rs also with
    each slice's GEMM + reduce-scatter as the 1-D GPU schedule ce_push:1 on the reducing axis
    (Config.mesh2d_axis_schedule)."""
    world, backend = four_ranks
    for rank, cases in enumerate(run_distributed(run_ops_2d, world, (1, 2, 4), ("", "ce_push:1"), backend=backend,
                                                 timeout_s=300)):
        assert len(cases) == 3 + 2 * 3 * 2, (rank, cases)
        bad = [(kind, s, got, one) for kind, s, got, one in cases if not within_tolerance(got, one)]
        assert not bad, (rank, bad)
