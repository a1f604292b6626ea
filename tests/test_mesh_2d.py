"""Data x tensor parallel: commopt on the "tp" dim of a 2-D mesh, where each TP group is a
subgroup of the world (global ranks {0, 1} and {2, 3}).  The rewrite, the rule, and autotune's
rank-0 decision broadcast must all work per subgroup."""

from __future__ import annotations

import logging

from dist_programs import run_dp_tp_block

from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance
from torch_commopt.tuner.matmul.autotune import Progress

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
