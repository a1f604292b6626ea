"""Graphs compiled with dynamic shapes: matmul regions with symbolic rows are rewritten with
schedule `auto` (the rule per call shape), one graph serves every size and matches eager;
what cannot take symbolic sizes is left alone, with one warning."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.auto import auto_schedule
from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import within_tolerance


def _group():
    return dist.group.WORLD.group_name


def _graphs():
    return torch_commopt.explain().graphs


# --- the pass, on a fake group --------------------------------------------------------------

def test_dynamic_rows_are_rewritten_with_auto(fake_world):
    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=_group()) @ b

    a = torch.randn(8, 16)
    torch._dynamo.mark_dynamic(a, 0)
    torch.compile(fn, backend="commopt")(a, torch.randn(16, 8))
    (graph,) = _graphs()
    (region,) = graph.rewritten
    assert region.schedule == "auto:4"
    assert not region.summary["a_shape"][0].isdigit() and region.summary["a_shape"][1] == 16
    assert any("dynamic" in n and "auto:4" in n for n in graph.notes), graph.notes


def test_dynamic_contracted_dim_is_left_alone_with_one_warning(fake_world, caplog, monkeypatch):
    from torch_commopt.passes import pipeline

    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=_group()) @ b

    monkeypatch.setitem(pipeline._warned, "dynamic", False)
    with caplog.at_level(logging.WARNING, logger="torch_commopt"):
        torch.compile(fn, backend="commopt", dynamic=True)(torch.randn(8, 16), torch.randn(16, 8))
        torch._dynamo.reset()
        torch.compile(fn, backend="commopt", dynamic=True)(torch.randn(6, 12), torch.randn(12, 8))
    graphs = _graphs()
    assert graphs and all(not g.rewritten for g in graphs)  # K symbolic too: a matmul needs it fixed
    assert any("dynamic shape" in s.reason and "last dim" in s.reason for g in graphs for s in g.skipped)
    warnings = [r.getMessage() for r in caplog.records if "dynamic shapes" in r.getMessage()]
    assert len(warnings) == 1 and "dynamic=False" in warnings[0], warnings


def test_fixed_schedule_and_cuda_graphs_and_budget(fake_world):
    def fn(a, b):
        return funcol.all_gather_tensor(a, gather_dim=0, group=_group()) @ b

    def schedule(**options):
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        a = torch.randn(8, 16)
        torch._dynamo.mark_dynamic(a, 0)
        torch.compile(fn, backend="commopt", options=options)(a, torch.randn(16, 8))
        (graph,) = _graphs()
        return [r.schedule for r in graph.rewritten], graph.notes

    assert schedule(schedule="chunked", chunks=3)[0] == ["chunked:3"]  # as named; the op cuts any size
    assert schedule(cuda_graphs=True, debug_waits=True)[0] == ["auto:4:dbg=1,graphs=1"]
    kept, notes = schedule(mode="model", memory_budget_mib=64)
    assert kept == [] and any("memory budget" in n and "kept as compiled" in n for n in notes), notes


# --- auto's per-call choice ----------------------------------------------------------------

def test_auto_picks_by_the_call_shape():
    def cuda(kind, rows, k, n, schedule="auto:1", dim=0):
        return auto_schedule(kind, schedule, (rows, k), ((k, n),), dim, 2, "bfloat16", "cuda")

    assert cuda("ag_matmul", 8, 8192, 8192) == "sequential"  # decode-sized: NCCL + cuBLAS
    assert cuda("ag_matmul", 4096, 8192, 8192).startswith("ce_push")
    assert cuda("matmul_rs", 16384, 8192, 8192) == "ce_pull:2"  # two ranks, bf16, long GEMM
    assert cuda("ag_matmul", 4096, 8192, 8192, "auto:1:dbg=1") == "ce_push:1:dbg=1,par=1"
    # the rule's host-bound band: a static region times its candidates at its first call, auto does not
    assert cuda("matmul_rs", 2048, 8192, 8192) == "sequential"
    assert cuda("matmul_rs", 2048, 8192, 8192, "auto:1:graphs=1") == "ce_push:1"  # replayed: no host cost
    assert cuda("matmul_ar", 7, 8192, 8192, dim=None) == "sequential"  # rows do not split
    # off CUDA: the reference in S pieces, at most one a row
    assert auto_schedule("ag_matmul", "auto:4", (3, 16), ((16, 8),), 0, 2, "float32", "cpu") == "chunked:3"
    assert auto_schedule("matmul_ar", "auto:4", (10, 16), ((16, 8),), None, 2, "float32", "cpu") == "chunked:4"


def test_auto_schedule_string():
    assert str(Schedule.parse("auto:4:graphs=1")) == "auto:4:graphs=1"
    assert all(Schedule.parse("auto").valid_for(k) for k in ("ag_matmul", "matmul_rs", "matmul_ar"))
    with pytest.raises(ValueError, match="graphs=0/1 is an auto option"):
        Schedule.parse("ce_push:2:graphs=1")


# --- live gloo groups: every size against eager ------------------------------------------------

def _assert_close(label, compiled, eager):
    assert within_tolerance(compiled, eager), f"{label}: commopt error {compiled:.2e} vs eager {eager:.2e}"


def test_funcol_programs_with_dynamic_rows_match_eager():
    from dynamic_programs import run_funcol

    for rank_results in run_distributed(run_funcol, 2, {"chunks": 2}):
        for name, graphs, schedules, per_size in rank_results:
            assert graphs == 1, f"{name}: {graphs} graphs for {len(per_size)} sizes"
            assert schedules and all(s == "auto:2" for s in schedules), f"{name}: {schedules}"
            for size, errors in per_size:
                for i, (c, e) in enumerate(errors):
                    _assert_close(f"{name} rows {size} output {i}", c, e)


def test_tp_sp_block_serves_every_sequence_length():
    # torch.compile's default (automatic dynamic shapes): a static graph, then one dynamic graph at
    # the first new length (dynamic=True from the start: the regather test below)
    from dynamic_programs import run_block

    # the sequence is sharded (SP): local lengths 8, 4, 12, then 8 again
    seqs = (16, 8, 24, 16)
    for graphs, schedules, per_seq, notes in run_distributed(run_block, 2, {"chunks": 2}, "tp_sp_block", seqs, None):
        assert graphs == 2, (graphs, notes)
        auto = [s for s in schedules if s == "auto:2"]
        assert len(auto) == 8, schedules  # q/k/v and w1/w3 gathers, wo and w2 reductions, both passes
        assert any("concat-K" in n for n in notes), notes  # the backward's sums of matmuls, symbolic rows
        for seq, errors in per_seq:
            for name, c, e in errors:
                _assert_close(f"seq {seq} {name}", c, e)


@pytest.mark.slow
def test_regather_with_dynamic_rows_matches_eager():
    # the joint-graph pass measured saved bytes with symbolic sizes and crashed the compile
    from dynamic_programs import run_block

    options = {"chunks": 2, "regather_for_backward": True}
    for graphs, _, per_seq, notes in run_distributed(run_block, 2, options, "tp_sp_block", (16, 8), True):
        assert graphs == 1 and any("re-gathered in backward" in n for n in notes), notes
        for seq, errors in per_seq:
            for name, c, e in errors:
                _assert_close(f"regather seq {seq} {name}", c, e)
