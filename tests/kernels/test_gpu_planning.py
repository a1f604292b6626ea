"""The CPU-testable parts of the GPU schedules: row layouts, dispatch, and the pick rule."""

from __future__ import annotations

import logging

import pytest
import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.gpu.layout import RowLayout
from torch_commopt.kernels.matmul.gpu.pick import measure_band, pick
from torch_commopt.kernels.matmul.ops import resolve
from torch_commopt.tuner.matmul.model import RegionFacts


@pytest.mark.parametrize("shape,dim,world", [((8, 6), 0, 2), ((2, 3, 5, 4), 1, 4), ((3, 7, 4), 0, 2), ((2, 5, 4), 1, 2)])
def test_block_rows_are_the_rank_blocks_of_a_gathered_tensor(shape, dim, world):
    shards = [torch.randn(shape) for _ in range(world)]
    full = torch.cat(shards, dim=dim)
    lay = RowLayout.of(list(shape), dim, world, gathered=True)
    rows = full.reshape(-1, shape[-1])
    for r, shard in enumerate(shards):
        for lo, hi in lay.pieces(3):
            got = lay.block_rows(rows, r, lo, hi)
            assert torch.equal(got.reshape(-1, shape[-1]), shard.reshape(-1, shape[-1])[lo:hi])


@pytest.mark.parametrize("outer,lin,world", [(4, 3, 2), (2, 5, 4), (3, 2, 3)])
def test_block_rows_of_outer_blocks_are_the_blocked_view(outer, lin, world):
    """block_rows (one as_strided) is full.view(outer, world, lin, X)[blocks, block], the same
    elements and strides, on a matrix whose rows are padded too (a column slice of a wider one)."""
    wide = torch.randn(outer * world * lin, 7)
    lay = RowLayout(outer, lin, world)
    for full in (wide, wide[:, :5]):
        for block in range(world):
            for lo, hi in lay.pieces(2) + [(0, lay.local_rows)]:
                got = lay.block_rows(full, block, lo, hi)
                want = full.view(outer, world, lin, full.shape[-1])[lo // lin: hi // lin, block]
                assert got.shape == want.shape and got.stride() == want.stride()
                assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)


@pytest.mark.parametrize("rows,outer,chunks", [(10, 1, 3), (10, 1, 20), (12, 3, 2), (12, 4, 5)])
def test_pieces_cover_the_rows_in_whole_units(rows, outer, chunks):
    lay = RowLayout(outer, rows // outer, 2)
    pieces = lay.pieces(chunks)
    assert pieces[0][0] == 0 and pieces[-1][1] == lay.local_rows
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all((hi - lo) % lay.unit == 0 or hi == lay.local_rows for lo, hi in pieces)
    assert len(pieces) <= chunks


def test_gpu_schedule_on_cpu_runs_its_reference_twin():
    assert str(resolve("ag_matmul", "ce_push:3", torch.device("cpu"), lambda s, capturing: None)) == "chunked:3"
    assert str(resolve("matmul_rs", "direct:1", torch.device("cpu"), lambda s, capturing: None)) == "sequential"


def test_schedule_of_another_op_is_an_error():
    with pytest.raises(ValueError, match="no schedule 'ce_pull'"):
        resolve("ag_matmul", "ce_pull:2", torch.device("cuda", 0), lambda s, capturing: None)


def test_refused_gpu_call_runs_sequential_and_logs(caplog):
    with caplog.at_level(logging.WARNING, logger="torch_commopt.kernels.matmul.ops"):
        got = resolve("matmul_rs", "fused:2", torch.device("cuda", 0), lambda s, capturing: "planted refusal")
    assert str(got) == "sequential" and "planted refusal" in caplog.text
    assert str(resolve("matmul_rs", "fused:2", torch.device("cuda", 0), lambda s, capturing: None)) == "fused:2"


@pytest.mark.parametrize("kind,a_shape,w_shapes,dim,expected", [
    ("ag_matmul", [4096, 8192], [[8192, 4096]], 0, "ce_push:1:par=1"),  # est. GEMM 0.79 ms
    ("ag_matmul", [8192, 8192], [[8192, 14336]], 0, "ce_push:1"),  # 5.5 ms: the GEMMs would only share SMs
    ("ag_matmul", [1024, 8192], [[8192, 4096]], 0, "ce_push:1"),  # M_global 2048: est. GEMM 0.2 ms
    ("ag_matmul", [256, 8192], [[8192, 4096]], 0, "sequential"),  # too short for its host cost
    ("ag_matmul", [4096, 8192], [[4, 8192, 4096]], 0, "sequential"),  # batched weights
    ("ag_matmul", [4096, 8192], [[16384, 4096]], 1, "sequential"),  # gather on the contracted dim
    ("matmul_rs", [8192, 4096], [[4096, 8192]], 0, "ce_pull:2"),  # est. GEMM 0.79 ms: two pieces, pulled
    ("matmul_rs", [16384, 4096], [[4096, 8192]], 0, "ce_pull:2"),  # 1.6 ms
    ("matmul_rs", [2048, 4096], [[4096, 8192]], 0, "ce_push:1"),  # short: one piece, as replayed
    ("matmul_rs", [4096, 4096], [[4096, 7168]], 0, "ce_push:1"),
    ("matmul_rs", [512, 4096], [[4096, 8192]], 0, "sequential"),
    ("matmul_ar", [2048, 4096], [[4096, 8192]], None, "sequential"),
    ("matmul_rs", [8191, 4096], [[4096, 8192]], 0, "sequential"),  # rows do not split evenly
    ("matmul_ar", [8192, 4096], [[4096, 8192]], None, "ce_pull:2"),  # two ranks: pulled, gathered on the local stream
    ("matmul_ar", [512, 64], [[64, 64]], None, "sequential"),
])
def test_pick_rule(kind, a_shape, w_shapes, dim, expected):
    sched, why = pick(kind, a_shape, w_shapes, dim, 2, "bfloat16")
    assert str(sched) == expected, why


def test_wide_and_float8_reductions_keep_pushed_pieces():
    # the in-place pull is a two-rank bf16 / fp16 path: wider groups sum W slots, float8 has no ce_pull
    assert str(pick("matmul_ar", [8192, 4096], [[4096, 8192]], None, 4, "bfloat16")[0]) == "ce_push:2"
    assert str(pick("matmul_rs", [16384, 4096], [[4096, 8192]], 0, 4, "bfloat16")[0]) == "ce_push:2"
    assert str(pick("matmul_ar", [8192, 4096], [[4096, 8192]], None, 2, "float8_e4m3fn")[0]) != "ce_pull:2"


def test_rule_under_cuda_graphs_ignores_host_cost():
    # M_global 512: eager calls are host-bound (sequential); graph replays pay GPU time only.
    assert str(pick("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16")[0]) == "sequential"
    # (replayed, a short all-gather runs one GEMM once everything is in)
    assert str(pick("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16", graphs=True)[0]) == \
        "ce_push:1:gemm=whole"
    # (M_global 2048, est. 0.2 ms: the peer's GEMM beside the own one, as replayed calls ran fastest)
    assert str(pick("ag_matmul", [1024, 8192], [[8192, 4096]], 0, 2, "bfloat16", graphs=True)[0]) == "ce_push:1:par=1"
    assert str(pick("ag_matmul", [1024, 8192], [[8192, 4096]], 0, 4, "bfloat16", graphs=True)[0]) == "ce_push:1"
    assert str(pick("matmul_rs", [512, 4096], [[4096, 8192]], 0, 2, "bfloat16", graphs=True)[0]) == "sequential"
    assert str(pick("matmul_rs", [2048, 4096], [[4096, 8192]], 0, 2, "bfloat16", graphs=True)[0]) == "ce_push:1"
    assert str(pick("matmul_ar", [2048, 4096], [[4096, 8192]], None, 2, "bfloat16", graphs=True)[0]) == "ce_push:1"
    assert str(pick("matmul_rs", [2048, 4096], [[4096, 8192]], 0, 2, "bfloat16")[0]) == "ce_push:1"
    assert str(pick("matmul_ar", [2048, 4096], [[4096, 8192]], None, 2, "bfloat16")[0]) == "sequential"
    # too little to hide stays sequential either way
    assert str(pick("ag_matmul", [8, 64], [[64, 64]], 0, 2, "bfloat16", graphs=True)[0]) == "sequential"


def test_float8_rule_at_two_ranks():
    f8 = "float8_e4m3fn"

    def at2(kind, a_shape, w_shape, graphs, world=2):
        dim = None if kind == "matmul_ar" else 0
        return str(pick(kind, a_shape, [w_shape], dim, world, f8, graphs=graphs)[0])

    # all-gathers: the peer's GEMM on a second stream, eager and replayed
    assert at2("ag_matmul", [4096, 8192], [8192, 4096], False) == "ce_push:1:par=1"
    assert at2("ag_matmul", [1024, 8192], [8192, 4096], True) == "ce_push:1:par=1"
    assert at2("ag_matmul", [1024, 8192], [8192, 4096], False) == "sequential"  # eager, host-bound
    assert at2("ag_matmul", [4096, 8192], [8192, 4096], False, world=4) == "ce_push:1"  # not measured there
    # replayed reductions: M_global 2048 (est. float8 GEMM 98 us) ships its bf16 product, 512 stays NCCL
    assert at2("matmul_rs", [2048, 4096], [4096, 8192], True) == "ce_push:1"
    assert at2("matmul_ar", [2048, 4096], [4096, 8192], True) == "ce_push:2"  # replayed all-reduces: two pieces
    assert at2("matmul_ar", [8192, 4096], [4096, 8192], True) == "ce_push:2"
    assert at2("matmul_rs", [512, 4096], [4096, 8192], True) == "sequential"
    # eager float8 all-reduces in the host-bound band time two pieces too
    assert measure_band("matmul_ar", [8192, 4096], [[4096, 8192]], None, 2, f8) == ["sequential", "ce_push:1", "ce_push:2"]
    assert measure_band("matmul_ar", [2048, 4096], [[4096, 8192]], None, 2, "bfloat16") == ["sequential", "ce_push:1"]
    # bf16 keeps its own rule (eager, par=1 only for GEMMs of 0.5-3 ms)
    assert str(pick("ag_matmul", [8192, 8192], [[8192, 14336]], 0, 2, "bfloat16")[0]) == "ce_push:1"
    assert str(pick("ag_matmul", [8192, 8192], [[8192, 14336]], 0, 2, f8)[0]) == "ce_push:1:par=1"


def test_replayed_short_all_gathers_over_several_peers_skip_the_whole_gemm():
    # 4 ranks: the whole GEMM waits for the last of three shards (4x H100: it lost to NCCL)
    def at4(rows):
        return str(pick("ag_matmul", [rows, 8192], [[8192, 2048]], 0, 4, "bfloat16", graphs=True)[0])

    assert at4(128) == "sequential"  # M_global 512, est. GEMM 25 us
    assert at4(512) == "ce_push:1"  # M_global 2048, est. 98 us
    assert at4(2048) == "ce_push:1"  # long: the usual rule
    assert str(pick("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16", graphs=True)[0]) == \
        "ce_push:1:gemm=whole"  # two ranks keep it


def test_replayed_short_reduce_scatters_over_several_peers_ship_their_pieces():
    # 4 ranks, replayed: est. GEMM 50-100 us runs ce_push:1 (4x H100: 0.202 vs NCCL 0.227 ms)
    def at4(kind, rows, graphs=True):
        return str(pick(kind, [rows, 2048], [[2048, 8192]], 0 if kind == "matmul_rs" else None, 4, "bfloat16",
                        graphs=graphs)[0])

    assert at4("matmul_rs", 2048) == "ce_push:1"  # M_global 2048, est. 98 us
    assert at4("matmul_rs", 512) == "sequential"  # M_global 512, est. 25 us
    assert at4("matmul_ar", 2048) == "sequential"  # the all-reduce keeps NCCL
    assert at4("matmul_rs", 2048, graphs=False) == "sequential"  # eager: host-bound
    # two ranks keep NCCL under 100 us (M_global 1024 at W = 2, est. 49 us)
    assert str(pick("matmul_rs", [1024, 2048], [[2048, 8192]], 0, 2, "bfloat16", graphs=True)[0]) == "sequential"


def test_long_all_gathers_over_several_peers_run_the_fused_kernel():
    # 4 ranks, est. GEMM >= 0.5 ms: one fused pass (4x H100: up to 10% ahead of ce_push:1)
    for graphs in (False, True):
        assert str(pick("ag_matmul", [1024, 8192], [[8192, 7168]], 0, 4, "bfloat16", graphs=graphs)[0]) == \
            "fused:2:tma=1"
        # shorter (8192^3 at 4 ranks, est. 0.39 ms) or fp32 (no fused kernel): ce_push:1; 2 ranks:
        # the peer's GEMM beside the own one
        assert str(pick("ag_matmul", [2048, 8192], [[8192, 2048]], 0, 4, "bfloat16", graphs=graphs)[0]) == "ce_push:1"
        assert str(pick("ag_matmul", [1024, 8192], [[8192, 7168]], 0, 4, "float32", graphs=graphs)[0]) == "ce_push:1"
        assert str(pick("ag_matmul", [2048, 8192], [[8192, 14336]], 0, 2, "bfloat16", graphs=graphs)[0]) == \
            "ce_push:1:par=1"


def test_fused_reduction_inside_a_capture_runs_ce_push(monkeypatch, caplog):
    import torch_commopt.kernels.matmul.ops as ops

    monkeypatch.setattr(ops, "capturing", lambda: True)
    refuse_fused = lambda s, capturing: "epoch barrier" if s.name == "fused" and capturing else None  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="torch_commopt.kernels.matmul.ops"):
        got = resolve("matmul_rs", "fused:3:store=ce", torch.device("cuda", 0), refuse_fused)
    assert str(got) == "ce_push:3" and "capturable" in caplog.text
    # no capturable alternative: sequential, logged
    got = resolve("matmul_rs", "fused:2", torch.device("cuda", 0), lambda s, capturing: "no buffer")
    assert str(got) == "sequential"


def test_host_bound_band_is_measured_not_guessed():
    # M_global 2048 / RS 4096x7168: which of NCCL and ce_push:1 wins eager depends on the host
    band = ["sequential", "ce_push:1"]
    assert measure_band("matmul_ar", [2048, 4096], [[4096, 8192]], None, 2, "bfloat16") == band
    assert measure_band("ag_matmul", [1024, 8192], [[8192, 4096]], 0, 2, "bfloat16") == band
    assert measure_band("matmul_rs", [4096, 4096], [[4096, 7168]], 0, 2, "bfloat16") == band + ["direct:1"]
    # long GEMMs, tiny ones, CUDA-graph replay and refused shapes are decided by the rule
    assert measure_band("matmul_rs", [8192, 4096], [[4096, 8192]], 0, 2, "bfloat16") is None
    assert measure_band("matmul_rs", [512, 4096], [[4096, 8192]], 0, 2, "bfloat16") is None
    assert measure_band("matmul_rs", [2048, 4096], [[4096, 8192]], 0, 2, "bfloat16", graphs=True) is None
    assert measure_band("matmul_rs", [2047, 4096], [[4096, 8192]], 0, 2, "bfloat16") is None


def test_replayed_short_two_rank_all_gathers_are_measured_as_replays():
    """M_global 512 (est. 49 us of GEMM): 2x H200 runs par=1 fastest there, 2x H100 gemm=whole,
    so a replayed region times both (and NCCL) at its first call; the rule's gemm=whole is the
    fallback.  Longer, wider, float8 and reduction regions stay with the rule."""
    cands = ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]
    args = ("ag_matmul", [256, 8192], [[8192, 4096]], 0)
    assert measure_band(*args, 2, "bfloat16", graphs=True) == cands
    assert measure_band(*args, 2, "float16", graphs=True) == cands
    assert str(pick(*args, 2, "bfloat16", graphs=True)[0]) == "ce_push:1:gemm=whole"
    assert measure_band(*args, 2, "bfloat16") is None  # eager: too short for a GPU schedule's host cost
    assert measure_band(*args, 4, "bfloat16", graphs=True) is None
    assert measure_band(*args, 2, "float8_e4m3fn", graphs=True) is None
    assert measure_band("ag_matmul", [1024, 8192], [[8192, 4096]], 0, 2, "bfloat16", graphs=True) is None  # 0.19 ms
    assert measure_band("ag_matmul", [4, 8192], [[8192, 4096]], 0, 2, "bfloat16", graphs=True) is None  # nothing to hide
    assert measure_band("matmul_rs", [512, 4096], [[4096, 8192]], 0, 2, "bfloat16", graphs=True) is None


@pytest.mark.parametrize("rows,n,world", [(1, 4096, 2), (8, 4096, 2), (32, 8192, 4), (3, 4096, 8), (64, 8192, 2)])
def test_replayed_small_all_reduces_time_the_low_latency_schedules_against_nccl(rows, n, world):
    """A decoder's row-parallel projection replayed from CUDA graphs (1-64 rows, a few KB to 1 MiB):
    NCCL, oneshot and twoshot are timed as replays at the first call, any row count (3 rows over 8
    ranks too); NCCL runs until then."""
    args = ("matmul_ar", [rows, 1024], [[1024, n]], None, world)
    assert measure_band(*args, "bfloat16", graphs=True) == ["sequential", "oneshot", "twoshot"]
    sched, why = pick(*args, "bfloat16", graphs=True)
    assert str(sched) == "sequential" and "until measured" in why


def test_the_low_latency_band_ends_at_the_16_mib_buffer_and_leaves_eager_float8_and_other_kinds_alone():
    big = ("matmul_ar", [2048, 14336], [[14336, 4096]], None, 2)  # exactly 16 MiB of product
    band = measure_band(*big, "bfloat16", graphs=True)
    rule, why = pick(*big, "bfloat16", graphs=True)
    # a long GEMM: the rule's own overlapped schedule is timed too, and runs until measured
    assert band[:3] == ["sequential", "oneshot", "twoshot"] and band[3:] == [str(rule)] != ["sequential"], band
    assert "until measured" in why
    assert measure_band("matmul_ar", [2049, 14336], [[14336, 4096]], None, 2, "bfloat16", graphs=True) is None
    assert measure_band("matmul_ar", [8, 1024], [[1024, 4096]], None, 2, "bfloat16") is None  # eager: host-bound
    assert measure_band("matmul_ar", [8, 1024], [[1024, 4096]], None, 2, "bfloat16", graphs="call") is None
    assert measure_band("matmul_ar", [8, 1024], [[1024, 4096]], None, 2, "float8_e4m3fn", graphs=True) is None
    assert measure_band("matmul_ar", [8, 1024], [[1024, 4096]], None, 16, "bfloat16", graphs=True) is None
    assert measure_band("matmul_rs", [8, 1024], [[1024, 4096]], 0, 2, "bfloat16", graphs=True) is None


def test_a_replayed_band_request_times_replays_without_a_host_check():
    from torch_commopt.tuner.matmul import autotune

    cands = ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]
    sched = autotune.band_request(RegionFacts("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16"), "cpu",
                                  cands, "ce_push:1:gemm=whole", autotune.TuneSite("g", None, "ag0"), graphs=True)
    req = autotune._REQUESTS[sched.param("id")]
    assert req.graphs and req.headroom == 0.0 and req.margin == autotune.REPLAYED_BAND_MARGIN < autotune.BAND_MARGIN
    assert req.key["graphs"] is True and req.key["host_headroom"] == 0.0
    assert req.key["margin"] == autotune.REPLAYED_BAND_MARGIN  # decided under its own margin
    eager = autotune.band_request(RegionFacts("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16"), "cpu",
                                  cands, "ce_push:1:gemm=whole", autotune.TuneSite("g", None, "ag0"))
    assert eager != sched  # measured apart: an eager measurement is not a replayed one


def test_a_replayed_measurement_that_captures_nothing_runs_the_fallback(monkeypatch):
    """capture_agreed found no capturable candidate on any rank (all agree): the first call
    runs the rule's pick untimed instead of failing the user's step."""
    from torch_commopt.tuner.matmul import autotune

    sched = autotune.band_request(RegionFacts("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16"), "cpu",
                                  ["sequential", "ce_push:1:par=1"], "ce_push:1:gemm=whole",
                                  autotune.TuneSite("g", None, "ag_nocap"), graphs=True)

    def nothing(*args, **kwargs):
        raise autotune.NothingCaptured("no candidate could be captured")
    monkeypatch.setattr(autotune, "measure_candidates", nothing)
    assert autotune.resolve_at_call(sched, lambda s: None, torch.device("cpu")) == "ce_push:1:gemm=whole"
    assert autotune.decided(sched) == "ce_push:1:gemm=whole"


def test_band_request_is_an_autotune_placeholder_with_the_rule_as_fallback():
    from torch_commopt.tuner.matmul import autotune

    sched = autotune.band_request(RegionFacts("matmul_rs", [4096, 4096], [[4096, 7168]], 0, 2, "bfloat16"), "cpu",
                                  ["sequential", "direct:1"], "direct:1", autotune.TuneSite("g", None, "rs0"))
    assert sched.name == "autotune"
    req = autotune._REQUESTS[sched.param("id")]
    assert req.candidates == ["sequential", "direct:1"] and req.fallback == "direct:1"
    assert autotune.decided(sched) is None
    again = autotune.band_request(RegionFacts("matmul_rs", [4096, 4096], [[4096, 7168]], 0, 2, "bfloat16"), "cpu",
                                  ["sequential", "direct:1"], "direct:1", autotune.TuneSite("g", None, "rs1"))
    assert again == sched  # identical layers share one measurement


def test_band_region_uses_the_cached_measurement_or_a_first_call_placeholder(tmp_path):
    # choose.band_pick, the compile pass's side of the host-bound band (no process group: the
    # decision is local, as in single-process tracing)
    from types import SimpleNamespace

    import torch_commopt.passes.choose as choose
    from torch_commopt import report as explain
    from torch_commopt.config import Config
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.matmul import autotune

    a = torch.fx.Graph().placeholder("a")
    a.meta["val"] = torch.empty(0)
    region = SimpleNamespace(kind="matmul_rs", a=a, dim=0, group_size=2, consumers=[SimpleNamespace(node=a)],
                             group_name="g", collective=SimpleNamespace(name="reduce_scatter_7"))
    shape, weights, band = [2048, 4096], [[4096, 8192]], ["sequential", "direct:1", "ce_push:2"]
    config = Config(cache_dir=str(tmp_path))
    report = explain.GraphReport(graph_id=0, graph_kind="forward", compile_id=None)
    facts = RegionFacts("matmul_rs", shape, weights, 0, 2, "bfloat16")
    sched, why = choose.band_pick(region, facts, band, Schedule("sequential"), "est.", config, report)
    assert sched.name == "autotune" and "timed at the first call" in why
    req = autotune._REQUESTS[sched.param("id")]
    assert req.candidates == band and req.fallback == "sequential" and req.cache_dir == str(tmp_path)
    # what the first call stores (rank 0) is what the next compile emits, without a placeholder
    TunerCache(str(tmp_path)).put(req.key, {"schedule": "direct:1", "measured_ms": {"direct:1": 0.3}})
    sched, why = choose.band_pick(region, facts, band, Schedule("sequential"), "est.", config, report)
    assert str(sched) == "direct:1" and "cached measurement" in why
    # a program replayed from CUDA graphs: its band region (a short all-gather) is timed as replays
    region.kind, cands = "ag_matmul", ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]
    replayed = Config(cache_dir=str(tmp_path), cuda_graphs=True)
    facts = RegionFacts("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16")
    sched, why = choose.band_pick(region, facts, cands, Schedule.parse("ce_push:1:gemm=whole"), "est.", replayed, report)
    req = autotune._REQUESTS[sched.param("id")]
    assert req.graphs and req.headroom == 0.0 and "replayed short all-gather" in why


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_a_decided_placeholder_runs_its_schedule_without_resolving_again(fake_world, monkeypatch):
    # once a band region's first call has measured, later calls take the winner's own path (for
    # `sequential`: the graph's NCCL + matmul, with nothing of the placeholder's resolution left)
    import torch.distributed as dist

    from torch_commopt.kernels.matmul import ops, sequential
    from torch_commopt.tuner.matmul import autotune

    group = dist.group.WORLD.group_name
    sched = autotune.band_request(RegionFacts("matmul_rs", [8, 4], [[4, 4]], 0, 2, "float32"), "cpu",
                                  ["sequential", "direct:1"], "direct:1",
                                  autotune.TuneSite(group, None, "rs_decided"))
    autotune._REQUESTS[sched.param("id")].decided = "sequential"  # as its first call's measurement
    ran = []
    monkeypatch.setattr(sequential, "matmul_rs", lambda *args: ran.append(args) or torch.zeros(4, 4))
    a, w = torch.randn(8, 4), torch.randn(4, 4)
    ops.matmul_rs(a, w, None, 0, "sum", 2, group, str(sched))  # resolves once
    assert ops._DECIDED[str(sched)] == "sequential" and len(ran) == 1

    def no_resolution(*args, **kwargs):
        raise AssertionError("a decided placeholder was resolved again")
    monkeypatch.setattr(ops, "resolve", no_resolution)
    ops.matmul_rs(a, w, None, 0, "sum", 2, group, str(sched))
    assert len(ran) == 2


def test_band_winner_leaves_sequential_only_by_a_margin():
    from torch_commopt.tuner.matmul.autotune import BAND_MARGIN, winner

    measured = {"sequential": 0.300, "ce_push:1": 0.300 * (1 - BAND_MARGIN / 2), "direct:1": 0.31}
    assert winner(measured) == "ce_push:1"  # autotune proper: the fastest
    assert winner(measured, BAND_MARGIN) == "sequential"  # within the margin: NCCL stays
    measured["ce_push:1"] = 0.300 * (1 - 2 * BAND_MARGIN)
    assert winner(measured, BAND_MARGIN) == "ce_push:1"
    assert winner({"ce_push:1": 0.2, "direct:1": 0.1}, BAND_MARGIN) == "direct:1"  # no sequential timed


def test_band_winner_needs_host_headroom():
    # a band call runs at max(GPU, host): a schedule whose enqueue time leaves no headroom under
    # sequential's time loses as soon as the host slows, however fast its first call measured
    from torch_commopt.tuner.matmul.autotune import BAND_HOST_HEADROOM as H
    from torch_commopt.tuner.matmul.autotune import BAND_MARGIN, winner

    measured = {"sequential": 0.288, "ce_push:1": 0.234, "direct:1": 0.256}
    roomy = {"sequential": 0.07, "ce_push:1": 0.288 / H * 0.9, "direct:1": 0.288 / H * 0.9}
    assert winner(measured, BAND_MARGIN, roomy, H) == "ce_push:1"
    tight = dict(roomy, **{"ce_push:1": 0.288 / H * 1.1})
    assert winner(measured, BAND_MARGIN, tight, H) == "direct:1"  # the next fastest with headroom
    assert winner(measured, BAND_MARGIN, dict(tight, **{"direct:1": 0.2}), H) == "sequential"
    assert winner(measured, BAND_MARGIN, {"sequential": 0.07}, H) == "sequential"  # not measured: no headroom
    assert winner(measured, BAND_MARGIN, tight) == "ce_push:1"  # headroom 0: no check (autotune proper)


def test_whole_gemm_is_an_all_gather_ce_push_option():
    from torch_commopt.core.schedule import Schedule

    whole = Schedule.parse("ce_push:1:gemm=whole")
    assert whole.valid_for("ag_matmul") and not whole.valid_for("matmul_rs")
    assert str(whole.reference_twin()) == "sequential" and str(whole) == "ce_push:1:gemm=whole"
    for bad in ("direct:1:gemm=whole", "ce_push:1:gemm=split"):
        with pytest.raises(ValueError, match="gemm"):
            Schedule.parse(bad)


def test_par_is_an_all_gather_ce_push_option():
    par = Schedule.parse("ce_push:2:par=1")
    assert par.valid_for("ag_matmul") and not par.valid_for("matmul_rs") and not par.valid_for("matmul_ar")
    assert str(par.reference_twin()) == "chunked:2" and str(par) == "ce_push:2:par=1"
    for bad in ("direct:1:par=1", "ce_push:1:par=2", "ce_push:1:gemm=whole,par=1"):
        with pytest.raises(ValueError, match="par"):
            Schedule.parse(bad)


def test_reduction_regions_are_planned_with_the_operand_the_op_receives():
    # SP reduce-scatter: mm of a 2-D input, the product viewed (B, S, D) and scattered on dim 1.
    # Judged on the 2-D mm input, dim 1 looked like the contracted dim and GPU schedules were
    # refused ("collective on the last dim"); the op receives A replayed to (B, S, K).
    from types import SimpleNamespace

    from torch.fx import Graph

    from torch_commopt.passes.choose import op_a_shape

    a = Graph().placeholder("a")
    a.meta["val"] = torch.empty(8192, 2048, device="meta")
    region = SimpleNamespace(kind="matmul_rs", a=a, t_shape=[1, 8192, 4096], dim=1)
    assert op_a_shape(region) == [1, 8192, 2048]
    assert str(pick("matmul_rs", op_a_shape(region), [[2048, 4096]], 1, 2, "bfloat16", graphs=True)[0]) == "ce_push:1"
    assert "last dim" in pick("matmul_rs", [8192, 2048], [[2048, 4096]], 1, 2, "bfloat16", graphs=True)[1]
    region.kind = "ag_matmul"
    assert op_a_shape(region) == [8192, 2048]


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_band_measurement_takes_more_rounds_and_the_fastest_host_round(fake_world, monkeypatch):
    # a host burst at the first call must not decide for the whole run: the band times more
    # rounds than autotune proper, and its host check takes each candidate's fastest round
    import itertools
    import time as time_mod

    import torch.distributed as dist

    from torch_commopt.tuner.matmul import autotune

    group = dist.group.WORLD.group_name
    sched = autotune.band_request(RegionFacts("matmul_rs", [8, 4], [[4, 4]], 0, 2, "float32"), "cpu",
                                  ["sequential", "direct:1"], "direct:1",
                                  autotune.TuneSite(group, None, "rs_rounds"))
    req = autotune._REQUESTS[sched.param("id")]
    assert req.rounds == autotune.BAND_ROUNDS > autotune.ROUNDS
    assert autotune.band_key(RegionFacts("matmul_rs", [8, 4], [[4, 4]], 0, 2, "float32"), "cpu",
                             ["sequential", "direct:1"])["host_check"] == "fastest round"
    monkeypatch.setattr(autotune, "TARGET_S", {"cpu": 1e-4, "cuda": 1e-4})
    burst = itertools.chain([2e-3] * 40, itertools.repeat(0.0))  # the first calls are slow
    calls = {"sequential": 0, "direct:1": 0}

    def run(s):
        calls[s] += 1
        time_mod.sleep(next(burst))

    host, floor = {}, {}
    measured = autotune.measure_candidates(run, ["sequential", "direct:1"], group, torch.device("cpu"),
                                           timing=autotune.Timing(rounds=autotune.BAND_ROUNDS),
                                           readings=autotune.Readings(host=host, host_floor=floor))
    assert set(measured) == set(host) == set(floor) == {"sequential", "direct:1"}
    assert all(floor[s] <= host[s] for s in floor)
    assert floor["sequential"] < 1.0  # ms: the fast rounds, not the burst's 2 ms calls
    assert min(calls.values()) >= autotune.BAND_ROUNDS


@pytest.mark.parametrize("fake_world", [2], indirect=True)
@pytest.mark.parametrize("graphs", [True, False])
def test_a_replayed_first_call_measures_on_a_helper_thread(fake_world, monkeypatch, tmp_path, graphs):
    """A program replayed from CUDA graphs makes its first call inside Inductor's CUDA-graph-tree
    warm-up, which routes the calling thread's allocations to the tree's pool: the measurement
    runs on a helper thread (symm.off_thread) after a device synchronize.  Eager ones stay on
    the caller's thread.  (CUDA faked: the device type is all this path reads.)"""
    import threading

    import torch.distributed as dist

    from torch_commopt.kernels.gpu import symm
    from torch_commopt.tuner.matmul import autotune

    group = dist.group.WORLD.group_name
    req = autotune.TuneRequest({"question": "t", "graphs": graphs, "id": str(tmp_path)}, ["sequential", "ce_push:1"],
                               "ce_push:1", group, str(tmp_path), graphs=graphs, name="ag_thread")
    sched = autotune.register(req)
    seen, synced = {}, []

    def fake_measure(run, candidates, *args, **kwargs):
        seen["thread"] = threading.current_thread().name
        return {"sequential": 2.0, "ce_push:1": 1.0}
    monkeypatch.setattr(autotune, "measure_candidates", fake_measure)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    monkeypatch.setattr(symm.torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    assert autotune.resolve_at_call(sched, lambda s: None, torch.device("cuda", 0)) == "ce_push:1"
    if graphs:
        assert seen["thread"] == "commopt-symm-setup" and synced
    else:
        assert seen["thread"] == threading.current_thread().name and not synced


def test_autotune_keeps_the_models_pick_unless_another_is_measured_faster_beyond_the_tie():
    from torch_commopt.tuner.matmul.autotune import MODEL_TIE, winner

    measured = {"sequential": 1.30, "ce_push:1": 1.000, "ce_push:1:par=1": 1.000 * (1 + MODEL_TIE / 2)}
    assert winner(measured) == "ce_push:1"  # no prior: the fastest
    assert winner(measured, prior="ce_push:1:par=1", tie=MODEL_TIE) == "ce_push:1:par=1"  # a tie: the model's
    measured["ce_push:1:par=1"] = 1.000 * (1 + 2 * MODEL_TIE)
    assert winner(measured, prior="ce_push:1:par=1", tie=MODEL_TIE) == "ce_push:1"  # measured faster beyond it
    assert winner(measured, prior="fused:1", tie=MODEL_TIE) == "ce_push:1"  # a prior not timed: no say
    # the margin over sequential still applies to the model's pick
    near_nccl = {"sequential": 0.300, "ce_push:1": 0.290, "direct:1": 0.292}
    assert winner(near_nccl, 0.05, prior="direct:1", tie=MODEL_TIE) == "sequential"

