"""Data x tensor parallel: commopt on the "tp" dim of a 2-D mesh, where each TP group is a
subgroup of the world (global ranks {0, 1} and {2, 3}).  The rewrite, the rule, and autotune's
rank-0 decision broadcast must all work per subgroup."""

from __future__ import annotations

import logging

from dist_programs import run_dp_tp_block

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance
from torch_commopt.tuner.matmul.rounds import Progress

# on CPU the rule runs chunked (Config.chunks pieces); autotune times its model's best two a region
OPTIONS = [{}, {"mode": "autotune", "autotune_top_k": 2}]


def test_tp_subgroups_of_a_dp_tp_mesh_match_eager():
    for rank, per_options in enumerate(run_distributed(run_dp_tp_block, 4, OPTIONS, timeout_s=600)):
        for options, (rewritten, errors) in zip(OPTIONS, per_options):
            # (autotune may measure `sequential` best on a busy CPU and keep a region as it was)
            assert rewritten >= 4 or "mode" in options, f"rank {rank} {options}: {rewritten} regions rewritten"
            bad = [i for i, (c, e) in enumerate(errors) if not within_tolerance(c, e)]
            assert not bad, f"rank {rank} {options}: tensors {bad} off: {errors}"


def test_progress_without_a_bar_logs_and_a_hidden_one_is_silent(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="torch_commopt.tuner.matmul.autotune"):
        shown = Progress(2, "commopt autotune x", show=True, bar=False)
        shown.step("ce_push:1")
        shown.step("sequential")
        shown.close()
        hidden = Progress(2, "commopt autotune y", show=False)
        hidden.step("ce_push:1")
        hidden.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["commopt autotune x: 1/2 ce_push:1", "commopt autotune x: 2/2 sequential"]
    assert capsys.readouterr().err == ""


def _two_axis_matmul(rank: int, world: int, slices=(None,), linear: bool = False, axis: str = "") -> list:
    """relu(X W).sum() with X and W sharded over both dims of a 2 x 2 mesh (DTensor gathers X
    along the columns and W along the rows; the backward gathers along both too), forward and
    backward, once per entry of `slices` (Config.mesh2d_slices).  linear: relu(F.linear(X, W)).sum()
    with W [N, K] (DTensor gathers X's rows along the mesh's dim 0 and reduce-scatters the product
    along dim 1; the gathered X is saved for the backward); axis: Config.mesh2d_axis_schedule.  Per
    entry (seconds of the compile and first step, the loss's and the gradients' largest errors
    against eager, the regions rewritten as (kind, schedule), the explain notes)."""
    import time

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torch_commopt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
    gen = torch.Generator().manual_seed(0)
    shapes = ((32, 64), (48, 64)) if linear else ((32, 64), (64, 48))
    x_full, w_full = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes)

    def step(fn):
        x, w = (distribute_tensor(t, mesh, [Shard(0), Shard(1)]).requires_grad_() for t in (x_full, w_full))
        loss = fn(x, w)
        loss.backward()
        return [loss.full_tensor(), x.grad.full_tensor(), w.grad.full_tensor()]

    def loss_of(x, w):
        return torch.relu(torch.nn.functional.linear(x, w) if linear else x @ w).sum()

    want = step(loss_of)
    out = []
    for s in slices:
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        t0 = time.perf_counter()
        got = step(torch.compile(loss_of, backend="commopt",
                                 options={"consistency_timeout_s": 20.0, "mesh2d_slices": s,
                                          "mesh2d_axis_schedule": axis}))
        seconds = time.perf_counter() - t0
        graphs = torch_commopt.explain().graphs
        out.append((seconds, [(g - e).abs().max().item() for g, e in zip(got, want, strict=True)],
                    [(r.kind, r.schedule) for g in graphs for r in g.regions if r.status == "rewritten"],
                    [n for g in graphs for n in g.notes]))
    return out


def test_a_graph_with_collectives_on_both_mesh_dims_is_agreed_at_once():
    """Ranks 0 and 1 share a row group but not a column group, whose names differ: the plan
    they compare renders the other dim's groups by role, so they agree at once instead of each
    waiting out the timeout for the other's vote and leaving the graph untouched.  Forward and
    backward, float64: the same loss and gradients as eager."""
    for rank, [(seconds, errors, rewritten, notes)] in enumerate(run_distributed(_two_axis_matmul, 4, timeout_s=300)):
        assert not [n for n in notes if "did not vote" in n or "NOT rewritten" in n], (rank, notes)
        # the forward's two gathers and matmul: one 2D GEMM; the backward's row gather (dX) and its
        # column gather (dW = Xᵀ dY, turned around: passes/matmul/b_gather.py): ag_matmul each
        assert [k for k, _ in rewritten] == ["gemm_2d", "ag_matmul", "ag_matmul"], (rank, rewritten)
        assert [n for n in notes if "B-side gather" in n], (rank, notes)
        assert max(errors) < 1e-9, (rank, errors)
        assert seconds < 20.0, (rank, seconds)
        assert [n for n in notes if n.startswith("gemm_2d") and "picked S = " in n], notes  # the model's pick


def test_the_2d_gemm_runs_every_slice_count_and_summa_against_eager():
    """Config.mesh2d_slices forces MeshSlice's S (2: slice 1's gathers in flight while slice 0
    multiplies; 1: the Collective 2D GEMM) or SUMMA (0): the same loss and gradients as eager."""
    per_rank = run_distributed(_two_axis_matmul, 4, (2, 1, 0), timeout_s=300)
    for rank, runs in enumerate(per_rank):
        schedules = [dict(rewritten)["gemm_2d"] for _, _, rewritten, _ in runs]
        assert schedules == ["meshslice:os:S=2", "collective (S=1)", "summa"], (rank, schedules)
        for _, errors, _, notes in runs:
            assert max(errors) < 1e-9 and not [n for n in notes if "NOT rewritten" in n], (rank, errors, notes)


def test_an_f_linear_on_a_2d_mesh_is_meshslices_rs_and_keeps_the_gathered_rows_for_backward():
    """F.linear(X, W) with both [Shard(0), Shard(1)]: DTensor gathers X's rows over the mesh's dim 0,
    multiplies by its W block and reduce-scatters the partial product over dim 1 -- MeshSlice's rs
    with the axes swapped.  The op hands back the gathered rows the backward keeps.  S = 2, 1 and
    0 (SUMMA cannot hand them back: S = 1 instead, noted); loss and gradients as eager's."""
    per_rank = run_distributed(_two_axis_matmul, 4, (2, 1, 0), True, timeout_s=300)
    for rank, runs in enumerate(per_rank):
        schedules = [dict(rewritten).get("gemm_2d") for _, _, rewritten, _ in runs]
        assert schedules == ["meshslice:rs:S=2", "collective (S=1)", "collective (S=1)"], (rank, schedules)
        assert [n for n in runs[2][3] if "not SUMMA" in n], runs[2][3]
        for _, errors, _, notes in runs:
            assert max(errors) < 1e-9 and not [n for n in notes if "NOT rewritten" in n], (rank, errors, notes)


def test_a_per_axis_schedule_runs_the_rs_region_and_os_keeps_c10d():
    """Config.mesh2d_axis_schedule: F.linear's region (rs) runs each slice's GEMM + reduce-scatter
    as the 1-D op with that schedule; X @ W's (os) reduces nothing and keeps c10d's gathers, noted.
    Loss and gradients as eager's."""
    for linear, want in ((True, "meshslice:rs:S=2, ce_push:1 per axis"), (False, "meshslice:os:S=2")):
        for rank, [(_, errors, rewritten, notes)] in enumerate(
                run_distributed(_two_axis_matmul, 4, (2,), linear, "ce_push:1", timeout_s=300)):
            assert dict(rewritten)["gemm_2d"] == want, (rank, rewritten)
            assert linear or [n for n in notes if "not ce_push:1 per axis" in n], (rank, notes)
            assert max(errors) < 1e-9 and not [n for n in notes if "NOT rewritten" in n], (rank, errors, notes)
