"""bench_matmul_collectives' report on synthetic records: a run of one timing mode renders that
mode's section only (a --modes graph run has no eager figures at the record's top level)."""

import pytest

from benchmarks import bench_matmul_collectives as bench

META = {"device": "X", "world": 4, "date": "d", "torch": "t", "triton": "tr", "commit": "c", "command": "cmd"}


def _mode(pick_ms: float) -> dict:
    res = {"gemm_ms": 0.1, "comm_ms": 0.12, "nccl_seq_ms": 0.226, "torch_async_tp_ms": 0.209, "commopt_ms": pick_ms,
           "schedules": {"sequential": 0.23, "ce_push:1": pick_ms}, "commopt_schedule": "ce_push:1",
           "round_range_ms": {"nccl_seq": [0.22, 0.23], "commopt": [0.2, 0.21]}, "paired_hidden_fraction": None,
           "paired_speedup_vs_best_baseline": 1.0, "best_schedule": "ce_push:1", "best_schedule_ms": pick_ms}
    bench._derive(res)
    return res


def _record(**modes) -> dict:
    rec = {"op": "rs", "M": 2048, "K": 8192, "N": 8192, "world": 4, "balanced": False,
           "errors_vs_nccl": {"sequential": 0.0, "ce_push:1": 3e-3}}
    if "eager" in modes:
        rec.update(modes["eager"])
    if "graph" in modes:
        rec["graph"] = modes["graph"]
    return rec


def test_a_graph_only_run_renders_its_replayed_section_alone():
    text = bench._report([_record(graph=_mode(0.206))], META)
    assert "CUDA-graph replay" in text and "Eager calls" not in text
    assert "| rs | 2048 | 8192 | 8192 |" in text and "1.015" in text  # 0.209 / 0.206


def test_both_modes_render_both_sections():
    text = bench._report([_record(eager=_mode(0.25), graph=_mode(0.206))], META)
    assert "Eager calls" in text and "CUDA-graph replay" in text
    assert "0.836" in text  # eager speedup 0.209 / 0.25


def test_the_overlap_floor_gives_the_hidden_fraction_ceiling():
    """hidden ceiling = (NCCL seq - floor) / (NCCL seq - max(GEMM, comm)), per median and per round;
    a run without the floor (an older report) renders '-'."""
    shape = bench.Shape("ag", 16384, 8192, 28672)
    rounds = {"gemm": [5.6, 5.5], "comm": [0.6, 0.6], "nccl_seq": [6.2, 6.1], "overlap_floor": [5.8, 5.6],
              "pick": [5.9, 5.7], "sched ce_push:1": [5.9, 5.7]}
    res = bench._summarize(rounds, shape, 2)
    res.update(commopt_schedule="ce_push:1")
    bench._derive(res)
    assert res["overlap_floor_ms"] == pytest.approx(5.7)
    assert res["hidden_fraction_ceiling"] == pytest.approx((6.15 - 5.7) / (6.15 - 5.55))
    assert res["paired_hidden_fraction_ceiling"] == pytest.approx(((6.2 - 5.8) / 0.6 + (6.1 - 5.6) / 0.6) / 2)
    assert res["hidden_fraction"] < res["hidden_fraction_ceiling"]
    text = bench._report([_record(eager=res)], META)
    assert "| 5.700 | 0.750 (0.750) |" in text
    old = _mode(0.2)
    assert old["hidden_fraction_ceiling"] is None and "| - | - (-) |" in bench._report([_record(eager=old)], META)


def test_the_recipe_shapes_are_the_symm_mem_recipes_nine_all_gathers_at_any_world():
    """--recipes: N and K a rank as the recipes give them (Llama-3 8B, 70B, 105B), M gathered."""
    from benchmarks.bench_matmul_collectives import Shape, shapes_for

    for world in (2, 4, 8):
        shapes = shapes_for(world, recipes=True)
        assert len(shapes) == 9 and {s.op for s in shapes} == {"ag"}
        assert Shape("ag", 16384, 8192, 3584 * world) in shapes  # the 70B one the issue anchors at
        assert {(s.N // world, s.K) for s in shapes} == {(1792, 4096), (3584, 8192), (6656, 16384)}
        assert {s.M for s in shapes} == {4096, 8192, 16384}
    assert shapes_for(2) != shapes_for(2, recipes=True)
