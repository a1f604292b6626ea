"""The reference 2D GEMMs (kernels/mesh2d/reference.py) on gloo meshes of 4 ranks (2 x 2) and 8
(2 x 4, 4 x 2): MeshSlice's os / ls / rs in 1 (the Collective 2D GEMM), 2 and 4 slices and by SUMMA, and
the FC layer forward and backward in every dataflow and its transposed form (two by SUMMA too), each
rank's blocks against the unsharded float64 products and autograd's gradients."""

import pytest
from mesh2d_programs import run_axis_schedules, run_gemms, run_gemms_staged

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (4, 2)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_2d_gemm_gives_the_unsharded_product_and_gradients(shape):
    for rank, errors in enumerate(run_distributed(run_gemms, shape[0] * shape[1], shape, (1, 2, 4), timeout_s=300)):
        assert len(errors) == 3 * 3 + 3 + 8 * 3, errors
        bad = {k: e for k, e in errors.items() if not e < 1e-10}
        assert not bad, (rank, bad)


def test_the_2d_gemms_staged_through_host_memory_give_the_same_products():
    """The path of ranks sharing one GPU over gloo (kernels/collectives.staged), run on the CPU."""
    for rank, errors in enumerate(run_distributed(run_gemms_staged, 4, (2, 2), (1, 2), timeout_s=300)):
        bad = {k: e for k, e in errors.items() if not e < 1e-10}
        assert len(errors) == 2 * 3 + 3 + 8 * 3 and not bad, (rank, bad)


def test_a_slice_count_that_does_not_cut_the_shard_is_refused():
    import torch

    from torch_commopt.kernels.mesh2d.reference import _slice

    with pytest.raises(ValueError, match="does not cut into 3 slices"):
        _slice(torch.zeros(4, 8), 1, 0, 3)
    x = torch.arange(12.0).view(1, 12)
    assert _slice(x, 1, 1, 3).tolist() == [[1.0, 4.0, 7.0, 10.0]]  # interleaved: p % 3 == 1


def test_the_fc_layer_runs_the_gemms_the_model_prices():
    """reference.FC_GEMMS (what fc_2d runs) and the cost model's _LAYER_GEMMS (what the tuner
    prices) agree on every dataflow and transposed form: the same kernels with the same M, N, K,
    read off the operands' stored forms (B tokens, I in-features, O out-features)."""
    from torch_commopt.kernels.mesh2d.reference import FC_GEMMS, stored_shapes
    from torch_commopt.tuner.mesh2d.model import _LAYER_GEMMS

    x_of = {("os", False): "BI", ("ls", False): "BI", ("rs", False): "IB",
            ("os", True): "IB", ("ls", True): "IB", ("rs", True): "BI"}
    w_of = {("os", False): "IO", ("ls", False): "OI", ("rs", False): "IO",
            ("os", True): "OI", ("ls", True): "IO", ("rs", True): "OI"}
    mnk = {"os": lambda a, b: a[0] + b[1] + a[1], "ls": lambda a, b: a[0] + b[0] + a[1],
           "rs": lambda a, b: a[1] + b[1] + a[0]}
    assert set(FC_GEMMS) == set(_LAYER_GEMMS)
    for form, gemms in FC_GEMMS.items():
        sizes = {"B": 2, "I": 3, "O": 5}
        as_letters = [tuple(sizes[c] for c in letters) for letters in (x_of[form], w_of[form], "OB" if form[1] else "BO")]
        assert list(stored_shapes(*form, 2, 3, 5)) == as_letters, form
        stored = {"x": x_of[form], "w": w_of[form], "dy": "OB" if form[1] else "BO"}
        got = tuple((kind, mnk[kind](stored[left], stored[right])) for kind, left, right in gemms)
        assert got == tuple(_LAYER_GEMMS[form]), form


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_per_axis_schedules_give_the_same_2d_products(shape):
    """ls and rs with each slice's GEMM + reduce-scatter as the 1-D matmul_rs op on the reducing
    axis (Config.mesh2d_axis_schedule): the unsharded product, as with c10d's reduce-scatter."""
    schedules = ("", "ce_push:1", "ce_pull:2")
    for rank, errors in enumerate(run_distributed(run_axis_schedules, shape[0] * shape[1], shape, schedules,
                                                  timeout_s=300)):
        assert len(errors) == len(schedules) * 2 * 3, errors
        bad = {k: e for k, e in errors.items() if not e < 1e-10}
        assert not bad, (rank, bad)


def test_a_per_axis_schedule_is_refused_where_it_cannot_run():
    from torch_commopt.kernels.mesh2d.ops import axis_schedule_error

    assert axis_schedule_error("rs", 2, "") is None and axis_schedule_error("ls", 1, "ce_push:1") is None
    assert "not os" in axis_schedule_error("os", 2, "ce_push:1")
    assert "SUMMA" in axis_schedule_error("rs", 0, "ce_push:1")
    assert "not a matmul_rs schedule" in axis_schedule_error("rs", 2, "ce_push:1:par=1")
    assert axis_schedule_error("rs", 2, "bogus:1") is not None
