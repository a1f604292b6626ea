"""The reference 2D GEMMs (kernels/mesh2d/reference.py) on gloo meshes of 4 ranks (2 x 2) and 8
(2 x 4, 4 x 2): MeshSlice's os / ls / rs in 1 (the Collective 2D GEMM), 2 and 4 slices and by SUMMA, and
the os, ls and rs FC layers forward and backward (os and rs by SUMMA too), each rank's blocks against the
unsharded float64 products."""

import pytest
from mesh2d_programs import run_gemms

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_2d_gemm_gives_the_unsharded_product_and_gradients(shape):
    for rank, errors in enumerate(run_distributed(run_gemms, shape[0] * shape[1], shape, (1, 2, 4), timeout_s=300)):
        assert len(errors) == 3 * 3 + 3 + 5 * 3, errors
        bad = {k: e for k, e in errors.items() if not e < 1e-10}
        assert not bad, (rank, bad)


def test_a_slice_count_that_does_not_cut_the_shard_is_refused():
    import torch

    from torch_commopt.kernels.mesh2d.reference import _slice

    with pytest.raises(ValueError, match="does not cut into 3 slices"):
        _slice(torch.zeros(4, 8), 1, 0, 3)
    x = torch.arange(12.0).view(1, 12)
    assert _slice(x, 1, 1, 3).tolist() == [[1.0, 4.0, 7.0, 10.0]]  # interleaved: p % 3 == 1
