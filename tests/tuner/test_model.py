"""The cost model: pipeline arithmetic, alpha-beta factors, orderings, calibration JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.tuner.calibration import Calibration, GemmFit, Link, prior
from torch_commopt.tuner.matmul.model import (
    RegionFacts,
    RegionShape,
    _Step,
    candidates,
    collective_time,
    extra_bytes,
    pipeline_time,
    predict,
    rank,
    simulate,
)

H200 = prior("NVIDIA H200", 2)
CPU = prior("cpu", 2)


def test_simulate_follows_queues_and_dependencies():
    steps = [_Step("comm", 3.0), _Step("compute", 1.0), _Step("compute", 2.0, (0,)), _Step("comm", 1.0, (1,))]
    # compute: [0,1] then waits for comm 0 (ends 3) -> [3,5]; comm 1 after comm 0 and compute 0 -> [3,4]
    assert simulate(steps) == 5.0


@pytest.mark.parametrize("comm,compute", [(2.0, 1.0), (1.0, 2.0), (1.5, 1.5)])
@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_simulated_pipeline_matches_the_closed_form(comm, compute, pieces):
    steps = []
    for _ in range(pieces):  # transfer of piece j, then its compute (all-gather shape)
        steps.append(_Step("comm", comm))
        steps.append(_Step("compute", compute, (len(steps) - 1,)))
    assert simulate(steps) == pytest.approx(pipeline_time(comm, pieces, comm, compute, compute))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_collectives_carry_the_p_minus_one_over_p_factor(world):
    link = Link(alpha_s=1e-5, bytes_per_s=1e11)
    cal = Calibration(device="x", world=world, collective={c: link for c in ("all_gather", "reduce_scatter", "all_reduce")},
                      gemm={"bfloat16": GemmFit(peak_flops=1e15, half_dim=0.0, launch_s=0.0)})
    n = 1 << 30
    expected = (world - 1) * 1e-5 + (world - 1) / world * n / 1e11
    assert collective_time(cal, "all_gather", n, world) == pytest.approx(expected)
    assert collective_time(cal, "reduce_scatter", n, world) == pytest.approx(expected)
    assert collective_time(cal, "all_reduce", n, world) == pytest.approx(2 * expected)
    assert collective_time(cal, "all_gather", n, 1) == 0.0


def test_thin_gemms_are_less_efficient():
    fit = GemmFit(peak_flops=1e15, half_dim=64.0, launch_s=0.0)
    square = fit.time(4096, 4096, 4096) / (4096 ** 3)
    thin = fit.time(4096, 16, 4096) / (4096 * 16 * 4096)
    assert thin > 4 * square


def test_a_compute_bound_gemm_splits_for_free_a_thin_one_does_not():
    """The roofline: rows split off a big GEMM cost nothing but launches (measured: 0-1%);
    a thin piece re-reads the whole weight from memory."""
    fit = GemmFit(peak_flops=8e14, elems_per_s=1.5e12, launch_s=0.0)
    assert 2 * fit.time(2048, 28672, 8192) == pytest.approx(fit.time(4096, 28672, 8192))
    assert 2 * fit.time(64, 8192, 8192) > 1.9 * fit.time(128, 8192, 8192)  # each half re-reads the weight
    assert fit.time(8192, 64, 8192) == pytest.approx((8192 * 8192 + 2 * 8192 * 64) / 1.5e12)


def test_gemms_with_fewer_tiles_than_sms_take_the_whole_machine_time():
    """Occupancy: under one 128 x 128 tile per SM the tensor cores run at the occupied share, so
    the halves of a 512-row GEMM (ag_matmul M_global 512, N_local 4096) each take the whole one's
    time; GEMMs that fill the SMs keep the roofline, and without an SM count nothing changes."""
    fit = GemmFit(peak_flops=8e14, elems_per_s=1e15, launch_s=0.0, sms=132)
    assert fit.occupancy(256, 4096) == pytest.approx(64 / 132) and fit.occupancy(4096, 4096) == 1.0
    assert fit.time(256, 4096, 8192) == pytest.approx(fit.time(512, 4096, 8192))
    assert fit.time(4096, 8192, 8192) == pytest.approx(2 * 4096 * 8192 * 8192 / 8e14)
    plain = GemmFit(peak_flops=8e14, elems_per_s=1e15, launch_s=0.0)
    assert 2 * plain.time(256, 4096, 8192) == pytest.approx(plain.time(512, 4096, 8192))


@pytest.mark.parametrize("cal,dtype", [(H200, "bfloat16"), (CPU, "float32")])
@pytest.mark.parametrize("kind,a_shape", [("ag_matmul", (256, 256)), ("matmul_rs", (512, 8))])
def test_sequential_wins_when_the_matmul_is_tiny(cal, dtype, kind, a_shape):
    """Nothing to hide the transfer behind: a pipeline only adds per-piece costs.  (Not
    `local_first`: one collective and no pieces, it hides the transfer behind the own
    shard's GEMM however small -- on 2 CPU ranks it measured 1.07 vs 1.89 ms for a
    256x256 shard at N = 8.)"""
    shape = RegionShape(kind, *a_shape, (8,), 2, dtype)
    pipelines = [s for s in candidates(shape, cal) if s.name != "local_first"]
    best = rank(shape, cal, pipelines)[0]
    assert best.schedule == Schedule("sequential"), best


@pytest.mark.parametrize("kind,a_shape,n,gain", [
    ("ag_matmul", (4096, 8192), 4096, 0.15), ("matmul_rs", (8192, 4096), 8192, 0.15),
    ("ag_matmul", (8192, 8192), 14336, 0.05),  # GEMM-heavy: the transfer is ~10% of the call
])
def test_overlap_wins_on_balanced_gpu_shapes(kind, a_shape, n, gain):
    preds = rank(RegionShape(kind, *a_shape, (n,), 2, "bfloat16"), H200)
    seq = next(p for p in preds if p.schedule.name == "sequential")
    assert preds[0].schedule.is_gpu and preds[0].seconds < (1 - gain) * seq.seconds, preds[:3]


@pytest.mark.parametrize("kind", ["ag_matmul", "matmul_rs"])
def test_overlap_wins_at_large_balanced_cpu_shapes(kind):
    preds = rank(RegionShape(kind, 4096, 1024, (1024,), 2, "float32"), CPU)
    assert preds[0].schedule.name in ("chunked", "local_first"), preds[:3]


def test_cpu_candidates_need_no_symmetric_memory():
    shape = RegionShape("matmul_rs", 1024, 256, (256,), 2, "float32")
    assert all(not p.schedule.is_gpu for p in rank(shape, CPU))
    with pytest.raises(ValueError, match="symmetric memory"):
        predict(shape, Schedule("direct", 1), CPU)


def test_a_schedule_the_op_lacks_is_an_error():
    with pytest.raises(ValueError, match="no schedule 'direct'"):
        predict(RegionShape("ag_matmul", 64, 64, (64,), 2), Schedule("direct", 1), H200)


def test_host_time_bounds_short_calls():
    p = predict(RegionShape("ag_matmul", 64, 64, (64,), 2), Schedule("ce_push", 1), H200)
    assert p.seconds == p.host_s > p.gpu_s


def test_concat_k_copies_are_charged_to_every_schedule_but_the_kept_one_which_pays_the_sum():
    """The backward's w1/w3 at Llama-3-8B TP 2 (seq 8192): dX = [d1 d3] @ [W1; W3], K 2 x 7168."""
    plain = RegionShape("matmul_rs", 8192, 14336, (4096,), 2, "bfloat16")
    copies = (8192 * 14336 + 14336 * 4096) * 2
    summed = int(1.5 * 8192 * 4096 * 2)  # kept as compiled: d1 W1 + d3 W3 adds two products
    fused = dataclasses.replace(plain, copy_bytes=copies, kept_bytes=summed)
    charge, kept = H200.local_copy.time(copies), H200.local_copy.time(summed)
    for sched in candidates(plain, H200):
        extra = predict(fused, sched, H200).gpu_s - predict(plain, sched, H200).gpu_s
        assert extra == pytest.approx(kept if sched.name == "sequential" else charge), sched
    chunked = Schedule("chunked", 2)  # the CPU prior has no device-copy figure: nothing charged
    assert predict(fused, chunked, CPU).gpu_s == predict(plain, chunked, CPU).gpu_s
    for field in ("copy_bytes", "kept_bytes"):
        with pytest.raises(ValueError, match=field):
            RegionShape("matmul_rs", 8, 8, (8,), 2, **{field: -1})


def test_k_parts_price_one_gemm_per_part_and_charge_the_copies_to_fused_only():
    plain = RegionShape("matmul_rs", 8192, 14336, (4096,), 2, "bfloat16")
    copies = (2 * 8192 * 7168 + 14336 * 4096) * 2  # what fused concatenates: both operands and weights
    parts = dataclasses.replace(plain, copy_bytes=copies, k_parts=(7168, 7168))
    fit = H200.gemm_fit("bfloat16")
    for sched in candidates(plain, H200):
        extra = predict(parts, sched, H200).gpu_s - predict(plain, sched, H200).gpu_s
        if sched.name == "fused":
            assert extra > H200.local_copy.time(copies) * 0.999, sched
        else:  # the parts' GEMMs instead of one over the whole K (a fixed cost more each), no copy
            assert 0 <= extra < H200.local_copy.time(copies), sched
    one, two = fit.time(8192, 4096, 14336), 2 * fit.time(8192, 4096, 7168)
    assert predict(parts, Schedule("sequential"), H200).gpu_s - predict(plain, Schedule("sequential"), H200).gpu_s \
        == pytest.approx(two - one, abs=1e-9)
    for bad in [(7168, 7000), (14336, 0)]:
        with pytest.raises(ValueError, match="k_parts"):
            dataclasses.replace(plain, k_parts=bad)


def test_memory_footprint_of_the_candidates():
    shape = RegionShape("matmul_rs", 1024, 512, (256,), 2, "bfloat16")
    full = 1024 * 256 * 2
    assert extra_bytes(shape, Schedule("sequential")) == full
    # direct: two buffer halves of W segments; ce_push adds a W-segment staging tensor
    assert extra_bytes(shape, Schedule("direct", 1)) == 2 * full
    assert extra_bytes(shape, Schedule("ce_push", 2)) == 3 * full
    ag = RegionShape("ag_matmul", 512, 256, (128,), 4, "bfloat16")
    assert extra_bytes(ag, Schedule("chunked", 2)) == 4 * 512 * 256 * 2


@pytest.mark.parametrize("cal", [H200, CPU])
def test_calibration_round_trips_through_json(cal):
    assert Calibration.from_json(cal.to_json()) == cal


def test_calibration_rejects_missing_collectives():
    with pytest.raises(ValueError, match="missing"):
        Calibration(device="x", world=2, collective={"all_gather": Link(alpha_s=0, bytes_per_s=1)})


def test_fits_recover_the_parameters_that_made_the_samples():
    from torch_commopt.tuner.calibrate import fit_gemm, fit_link

    shapes = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 8192), (8192, 64, 8192), (256, 8192, 8192)]
    for sms in (0, 132):  # CPU; a GPU, whose 1024^3 sample has 64 tiles for 132 SMs
        truth = GemmFit(peak_flops=8e14, elems_per_s=1.5e12, launch_s=4.5e-6, sms=sms)
        fit = fit_gemm([(m, n, k, truth.time(m, n, k)) for m, n, k in shapes], sms)
        assert fit.peak_flops == pytest.approx(8e14, rel=1e-6) and fit.elems_per_s == pytest.approx(1.5e12, rel=1e-6)
        assert fit.launch_s == pytest.approx(4.5e-6, rel=1e-4) and fit.sms == sms
    link = Link(alpha_s=2e-5, bytes_per_s=2e11)
    sizes = (1 << 20, 16 << 20, 64 << 20)
    got = fit_link(4, sizes, tuple(3 * link.time(n / 4) for n in sizes), steps=3)
    assert got.alpha_s == pytest.approx(2e-5, rel=1e-6) and got.bytes_per_s == pytest.approx(2e11, rel=1e-6)
    # a noisy, non-increasing set falls back to the best throughput seen, not the outlier's
    flat = fit_link(2, (1 << 20, 4 << 20, 64 << 20), (1e-4, 3e-4, 5e-2), steps=1)
    assert flat.alpha_s == 0.0 and flat.bytes_per_s == pytest.approx((4 << 20) / 2 / 3e-4)


def test_calibration_spots_timings_no_line_fits():
    """One slow sample among the collective sizes triggers a re-measurement (calibrate)."""
    from torch_commopt.tuner.calibrate import _consistent

    sizes = (1 << 20, 16 << 20, 64 << 20)
    assert _consistent(sizes, (2e-5, 8e-5, 3e-4))
    assert not _consistent(sizes, (2e-5, 8e-5, 5e-3))  # 64 MiB at a tenth of the bandwidth
    assert not _consistent(sizes, (3e-4, 8e-5, 3e-4))  # the smallest size slowest


def test_explain_command_prints_the_ranking(capsys, tmp_path):
    from torch_commopt.__main__ import main

    assert main(["explain", "--shape", "matmul_rs:8192x4096x8192", "--shape", "ag_matmul:256x8192x4096",
                 "--device", "NVIDIA H200", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "cost model: prior calibration of NVIDIA H200 x2, bfloat16"
    rs = out[2:out.index("ag_matmul:256x8192x4096:")]
    times = [float(line.split()[1]) for line in rs]
    assert times == sorted(times) and rs[0].split()[0] != "sequential"
    assert out[out.index("ag_matmul:256x8192x4096:") + 1].split()[0] == "sequential"
    with pytest.raises(ValueError, match="bad --shape"):
        main(["explain", "--shape", "matmul_rs:8192x4096"])


def test_a_reduction_takes_its_own_host_cost_per_piece_where_probed():
    # 2x H100 (s47): RS M_global 512 ce_push:4 ran 0.13-0.17 ms a piece of host beyond ce_push:1,
    # the all-gather's figure 0.067; AR 8192^3 ce_push:4 measured 1.23-1.28 ms eagerly against
    # 1.01-1.03 predicted with the all-gather's figure
    from torch_commopt.tuner.calibrate import HOST_PROBES, _host_families, _per_piece_by_kind

    assert {("matmul_rs", "ce_push:4"), ("matmul_ar", "ce_push:4")} <= set(HOST_PROBES["cuda"])
    hosts = {"ag_matmul ce_push:1": 150e-6, "ag_matmul ce_push:4": 270e-6, "matmul_rs ce_push:1": 300e-6,
             "matmul_rs ce_push:4": 750e-6, "matmul_ar ce_push:1": 400e-6}
    by_kind = _per_piece_by_kind(hosts, 2)
    assert by_kind == {"matmul_rs": pytest.approx(150e-6)}  # AR: one piece count only
    fam, shared = _host_families(hosts, 2, 0.0, by_kind)
    assert shared == pytest.approx(40e-6) and fam["matmul_rs ce_push"] == 300e-6
    cal = dataclasses.replace(H200, host_s={**H200.host_s, **fam}, host_per_piece_s=shared,
                              host_per_piece_by_kind=by_kind)
    assert cal.per_piece("matmul_rs") == pytest.approx(150e-6) and cal.per_piece("matmul_ar") == pytest.approx(40e-6)
    four = Schedule("ce_push", 4)
    rs = predict(RegionShape("matmul_rs", 64, 64, (64,), 2), four, cal)
    ar = predict(RegionShape("matmul_ar", 64, 64, (64,), 2), four, cal)
    assert rs.host_s == pytest.approx(300e-6 + 4 * 150e-6) and ar.host_s == pytest.approx(400e-6 + 4 * 40e-6)
    assert Calibration.from_json(cal.to_json()) == cal
    old = json.loads(cal.to_json())
    del old["host_per_piece_by_kind"]  # a calibration stored before: the shared figure for every op
    assert Calibration.from_json(json.dumps(old)).per_piece("matmul_rs") == pytest.approx(40e-6)


def test_an_ops_own_host_figure_is_used_where_it_was_measured():
    from torch_commopt.tuner.calibrate import _host_families

    # probes as calibrate times them ("kind schedule": seconds a call); per piece from ce_push:4
    hosts = {"ag_matmul sequential": 70e-6, "ag_matmul ce_push:1": 150e-6, "ag_matmul ce_push:4": 270e-6,
             "matmul_rs ce_push:1": 300e-6, "matmul_ar ce_push:1": 400e-6, "matmul_rs direct:1": 200e-6}
    fam, per_piece = _host_families(hosts, 2, 0.0)
    assert per_piece == pytest.approx(40e-6)
    # a family's figure is its first probe's, every probe also gives its op's own (one piece at
    # two ranks: nothing to take off; ce_push:4's four pieces are, had it come first)
    assert fam["ce_push"] == fam["ag_matmul ce_push"] == 150e-6
    assert fam["matmul_rs ce_push"] == 300e-6 and fam["matmul_ar ce_push"] == 400e-6
    assert fam["sequential"] == fam["ag_matmul sequential"] == 70e-6 and fam["direct"] == 200e-6
    assert _host_families({"ag_matmul ce_push:4": 270e-6}, 2, 40e-6)[0]["ce_push"] == pytest.approx(110e-6)
    cal = dataclasses.replace(H200, host_s={**H200.host_s, **fam}, host_per_piece_s=per_piece)
    assert cal.host("ce_push", "matmul_rs") == fam["matmul_rs ce_push"]
    assert cal.host("direct", "matmul_ar") == cal.host("direct") == fam["direct"]  # no AR probe: the family's
    assert cal.host("ce_pull", "matmul_ar") == H200.host_s["ce_pull"]  # never probed: the prior's
    one = Schedule("ce_push", 1)
    rs = predict(RegionShape("matmul_rs", 64, 64, (64,), 2), one, cal)
    ag = predict(RegionShape("ag_matmul", 64, 64, (64,), 2), one, cal)
    assert rs.host_s == fam["matmul_rs ce_push"] and ag.host_s == fam["ce_push"]
    assert rs.seconds == rs.host_s > rs.gpu_s  # a call this short is the host's
    two = predict(RegionShape("matmul_rs", 64, 64, (64,), 2), Schedule("ce_push", 2), cal)
    assert two.host_s == pytest.approx(fam["matmul_rs ce_push"] + 2 * per_piece)
    # a calibration without the ops' figures (every one stored before them) predicts as before
    assert predict(RegionShape("matmul_rs", 64, 64, (64,), 2), one, H200).host_s == H200.host("ce_push")


def test_cuda_graph_replay_drops_the_host_cost():
    # M_global 512 at K = N = 8192 on 2x H200: eager calls are host-bound (sequential wins);
    # replayed from a graph only GPU time counts and an overlapped schedule ranks first.
    gpu, cpu = prior("NVIDIA H200", 2), prior("cpu", 2)
    shape = RegionShape("ag_matmul", 256, 8192, (4096,), 2, "bfloat16")
    assert str(rank(shape, gpu)[0].schedule) == "sequential"
    replayed = rank(shape, gpu, graphs=True)
    assert replayed[0].schedule.is_gpu and all(p.host_s == 0 and p.seconds == p.gpu_s for p in replayed)
    # a CPU has no graphs to replay: the flag changes nothing there
    small = RegionShape("ag_matmul", 64, 64, (64,), 2, "float32")
    assert [p.seconds for p in rank(small, cpu, graphs=True)] == [p.seconds for p in rank(small, cpu)]


def test_autotune_keys_tell_graph_replay_apart():
    from torch_commopt.tuner.matmul.autotune import plan

    args = (RegionFacts("ag_matmul", [256, 8192], [[8192, 4096]], 0, 2, "bfloat16", bias=[False]), "NVIDIA H200",
            prior("NVIDIA H200", 2), 8, 4)
    eager, replayed = plan(*args), plan(*args, True)
    assert "cuda_graphs" not in eager[3] and replayed[3]["cuda_graphs"] is True
    assert eager[0] != replayed[0]  # sequential eager, an overlapped schedule replayed


def test_replayed_fused_reductions_are_ranked_as_what_runs():
    # inside a capture a fused reduction runs ce_push with its pieces
    shape = RegionShape("matmul_rs", 8192, 4096, (8192,), 2, "bfloat16")
    fused = predict(shape, Schedule("fused", 4), H200, graphs=True)
    push = predict(shape, Schedule("ce_push", 4), H200, graphs=True)
    assert fused.seconds == push.seconds
    assert not [c for c in candidates(shape, H200, graphs=True) if c.name == "fused"]
    assert [c for c in candidates(shape, H200) if c.name == "fused"]


def test_ce_pull_is_a_candidate_over_two_ranks_only():
    # over more it runs ce_push (matmul_reduce.pull_placed): ranking it would rank ce_push twice
    for kind in ("matmul_rs", "matmul_ar"):
        pulls = {w: [c for c in candidates(RegionShape(kind, 8192, 4096, (8192,), w, "bfloat16"), H200)
                     if c.name == "ce_pull"] for w in (2, 4)}
        assert pulls[2] and not pulls[4], kind


def test_family_factor_is_interpolated_between_a_short_and_a_long_probe():
    cal = dataclasses.replace(prior("NVIDIA H200", 2), schedule_factor={"matmul_rs ce_push": 1.0},
                              schedule_factor_curve={"matmul_rs ce_push": [[1e-3, 1.0], [1e-4, 0.8]]})
    assert cal.factor("matmul_rs ce_push", 1e-4) == pytest.approx(0.8)
    assert cal.factor("matmul_rs ce_push", 1e-5) == pytest.approx(0.8)  # clamped to the end points
    assert cal.factor("matmul_rs ce_push", 5e-3) == pytest.approx(1.0)
    mid = 10 ** -3.5  # halfway in log(time)
    assert cal.factor("matmul_rs ce_push", mid) == pytest.approx(0.9)
    assert cal.factor("matmul_rs direct", 1e-4) == 1.0  # no curve, no factor
    one_point = dataclasses.replace(cal, schedule_factor_curve={"matmul_rs ce_push": [[1e-3, 1.2]]})
    assert one_point.factor("matmul_rs ce_push", 1e-4) == 1.0  # falls back to schedule_factor
    assert Calibration.from_json(cal.to_json()) == cal
    # the model applies it to the family's raw prediction: a short reduction gets the short factor
    shape = RegionShape("matmul_rs", 2048, 4096, (8192,), 2)
    plain = predict(shape, Schedule("ce_push", 2), prior("NVIDIA H200", 2), graphs=True).gpu_s
    curved = predict(shape, Schedule("ce_push", 2), cal, graphs=True).gpu_s
    assert curved == pytest.approx(plain * cal.factor("matmul_rs ce_push", plain))
    assert curved < plain


def test_factor_curves_pair_the_two_probes_of_each_family():
    from torch_commopt.tuner.probe_factors import _factor_curves

    long = {"matmul_rs ce_push": (1e-3, 1.1), "matmul_rs fused": (1e-3, 1.3)}
    short = {"matmul_rs ce_push": (1e-4, 0.85), "ag_matmul ce_push": (1e-4, 0.9)}
    assert _factor_curves(long, short) == {"matmul_rs ce_push": [[1e-4, 0.85], [1e-3, 1.1]]}


def test_a_probed_piece_count_has_its_own_factor():
    cal = dataclasses.replace(H200, schedule_factor={"matmul_rs direct": 1.2, "matmul_rs direct:2": 1.5})
    assert cal.factor("matmul_rs direct:2", 1e-3) == 1.5
    assert cal.factor("matmul_rs direct:1", 1e-3) == 1.2  # not probed alone: the family's
    shape = RegionShape("matmul_rs", 8192, 4096, (8192,), 2)
    for s, f in ((Schedule("direct", 2), 1.5), (Schedule("direct", 4), 1.2)):
        assert predict(shape, s, cal).gpu_s == pytest.approx(predict(shape, s, H200).gpu_s * f)


def test_factors_are_keyed_by_family_and_by_piece_count():
    from torch_commopt.tuner.probe_factors import _schedule_factors

    shape = {"matmul_rs": ((8192, 4096), (4096, 8192))}
    raw = {s: predict(RegionShape("matmul_rs", 8192, 4096, (8192,), 2, "bfloat16"), Schedule.parse(s), H200).gpu_s
           for s in ("direct:1", "direct:2")}
    timed = {"matmul_rs direct:1": raw["direct:1"] * 1.1, "matmul_rs direct:2": raw["direct:2"] * 1.4}
    out = _schedule_factors(timed, H200, shape)
    assert out["matmul_rs direct"][1] == pytest.approx(1.1)  # the first probe stands for the family
    assert out["matmul_rs direct:2"][1] == pytest.approx(1.4)


def test_an_eager_probe_is_host_bound_by_its_measured_time_not_by_the_uncorrected_model():
    from torch_commopt.tuner.probe_factors import HOST_BOUND, PROBE_SHAPES, _schedule_factors

    (rows, k), (_, n) = PROBE_SHAPES["matmul_rs"]
    shape = RegionShape("matmul_rs", rows, k, (n,), 2, "bfloat16")
    # the host figure above the model's raw device time, which runs 40% slower than it says
    raw = predict(shape, Schedule.parse("fused:2"), H200).gpu_s
    cal = dataclasses.replace(H200, host_s=dict(H200.host_s, fused=raw * 1.1 - 2 * H200.host_per_piece_s))
    host = predict(shape, Schedule.parse("fused:2"), cal).host_s
    assert host == pytest.approx(raw * 1.1)
    out = _schedule_factors({"matmul_rs fused:2": raw * 1.4}, cal)  # device-bound: measured well above the host
    assert out["matmul_rs fused:2"][1] == pytest.approx(1.4)
    assert out["matmul_rs fused"][1] == pytest.approx(1.4)
    hidden = host * HOST_BOUND * 0.99  # within the host's figure: no device time to read
    assert _schedule_factors({"matmul_rs fused:2": hidden}, cal) == {}


def test_a_family_its_probes_gave_no_factor_takes_its_ops_median_not_one(caplog):
    from torch_commopt.tuner.probe_factors import _unmeasured_families

    probed = ["matmul_rs sequential", "matmul_rs ce_push:2", "matmul_rs ce_pull:2", "matmul_rs fused:2",
              "matmul_rs fused:2:tma=1", "matmul_ar ce_push:2"]
    eager = {"matmul_rs sequential": 1.1, "matmul_rs sequential:1": 1.1, "matmul_rs ce_pull": 1.2,
             "matmul_rs ce_pull:2": 1.2, "matmul_rs direct": 1.3, "matmul_rs direct:2": 1.9}
    replayed = {"matmul_rs ce_push": (1e-3, 1.25), "matmul_ar ce_push": (1e-3, 1.2)}
    with caplog.at_level("WARNING", logger="torch_commopt.tuner.probe_factors"):
        out = _unmeasured_families(probed, eager, replayed)
    assert out == {"matmul_rs fused": pytest.approx(1.2)}  # median of 1.1, 1.2, 1.3; ce_push has its replayed curve
    assert "matmul_rs fused got no factor" in caplog.text
    cal = dataclasses.replace(H200, schedule_factor={**eager, **out})
    assert cal.factor("matmul_rs fused:2", 1e-3) == pytest.approx(1.2)


def test_one_piece_reduction_at_two_ranks_does_not_wait_for_the_partial_before_its_gemm():
    shape = RegionShape("matmul_rs", 8192, 8192, (8192,), 2, "bfloat16")
    one = predict(shape, Schedule("ce_push", 1), H200, graphs=True).gpu_s
    gemm_half = predict(RegionShape("matmul_rs", 4096, 8192, (8192,), 1, "bfloat16"), Schedule("sequential"), H200,
                        graphs=True).gpu_s
    push = H200.p2p.time(4096 * 8192 * 2)
    assert one < 2 * gemm_half + push  # the push hides under the own GEMM


def test_reductions_over_several_peers_run_the_own_gemm_before_the_last_partial_lands():
    # 4 ranks, a slow link (a push takes two GEMM pieces): the pushes end at q + 3P, the own
    # GEMM (the fourth piece) ends at 4q beside them, then one pass sums the four slots
    from torch_commopt.tuner.matmul.model import _gemm

    shape = RegionShape("matmul_rs", 8192, 2048, (8192,), 4, "bfloat16")
    base = prior("NVIDIA H200", 4)
    q = _gemm(shape, base, 2048)
    piece_bytes = 2048 * 8192 * 2
    slow = Link(alpha_s=0.0, bytes_per_s=piece_bytes / (2 * q))
    cal = dataclasses.replace(base, p2p=slow, overlap_slowdown=0.0)
    total = base.local_copy.time(2.5 * piece_bytes)  # reads 4 pieces, writes 1
    assert cal.factor("matmul_rs ce_push:1", 1e-3) == cal.factor("matmul_ar ce_push:1", 1e-3) == 1.0  # a prior
    got = predict(shape, Schedule("ce_push", 1), cal, graphs=True).gpu_s
    assert got == pytest.approx(q + 3 * 2 * q + total)  # not q + 3P + q: the own GEMM did not wait
    # the all-reduce adds the pushes of the reduced piece to three peers after the sum, then
    # copies the three peers' reduced pieces from its slots into the output on the same stream
    ar = predict(dataclasses.replace(shape, kind="matmul_ar"), Schedule("ce_push", 1), cal, graphs=True).gpu_s
    assert ar == pytest.approx(q + 3 * 2 * q + total + 3 * 2 * q + 3 * base.local_copy.time(piece_bytes))


def test_whole_gemm_all_gather_pays_the_push_then_one_gemm_and_keys_its_own_factor():
    from torch_commopt.tuner.matmul.model import _gemm, factor_key
    from torch_commopt.tuner.probe_factors import _schedule_factors

    whole = Schedule.parse("ce_push:1:gemm=whole")
    shape = RegionShape("ag_matmul", 256, 8192, (4096,), 2, "bfloat16")
    shard = 256 * 8192 * 2
    expected = max(H200.p2p.time(shard), H200.local_copy.time(shard) if H200.local_copy else 0.0) + _gemm(shape, H200, 512)
    assert predict(shape, whole, H200, graphs=True).gpu_s == pytest.approx(expected)
    # 4 ranks: each pushes its shard to three peers in turn, the GEMM waits for the last
    at4 = RegionShape("ag_matmul", 256, 8192, (4096,), 4, "bfloat16")
    h200_4 = prior("NVIDIA H200", 4)
    assert predict(at4, whole, h200_4, graphs=True).gpu_s == pytest.approx(
        3 * h200_4.p2p.time(shard) + _gemm(at4, h200_4, 1024))
    assert whole in candidates(shape, H200)
    assert not any(s.param("gemm") for s in candidates(RegionShape("matmul_rs", 512, 4096, (8192,), 2), H200))
    assert factor_key("ag_matmul", whole) == "ag_matmul ce_push:1:gemm=whole"
    probes = {"ag_matmul ce_push:1": 1e-3, "ag_matmul ce_push:1:gemm=whole": 1e-3}
    raw = {k: predict(RegionShape("ag_matmul", 6144, 6144, (3072,), 2, "bfloat16"), Schedule.parse(k.split()[1]),
                      H200).gpu_s for k in probes}
    out = _schedule_factors({k: raw[k] * f for k, f in zip(probes, (1.1, 1.3))}, H200)
    assert out["ag_matmul ce_push:1:gemm=whole"][1] == pytest.approx(1.3)
    assert out["ag_matmul ce_push:1"][1] == pytest.approx(1.1)


def test_autotune_times_every_piece_count_of_each_family_it_times():
    from torch_commopt.tuner.matmul.autotune import timed_candidates

    for shape in (RegionShape("matmul_ar", 8192, 4096, (8192,), 2, "bfloat16"),
                  RegionShape("matmul_rs", 16384, 4096, (7168,), 2, "bfloat16"),
                  RegionShape("ag_matmul", 16384, 8192, (14336,), 2, "bfloat16")):
        preds = rank(shape, H200)
        for k in (1, 2, 4):
            top = timed_candidates(preds, k)
            families = {(p.schedule.name, p.schedule.params) for p in preds[:k]}
            siblings = {str(p.schedule) for p in preds if (p.schedule.name, p.schedule.params) in families}
            assert siblings <= set(top)  # e.g. ce_push:1, :2 and :4 when ce_push:1 is among the top k
            assert top[:k] == [str(p.schedule) for p in preds[:k]] and "sequential" in top
            assert len(top) == len(set(top))
            others = {str(p.schedule) for p in preds} - siblings - {"sequential"}
            assert not others & set(top)  # nothing from a family outside the top k
    preds = rank(RegionShape("matmul_ar", 8192, 4096, (8192,), 2, "bfloat16"), H200)
    first = preds[0].schedule
    assert len([p for p in preds if (p.schedule.name, p.schedule.params) == (first.name, first.params)]) > 1


def test_the_tma_fused_variant_is_its_own_candidate():
    from torch_commopt.tuner.matmul.model import factor_key

    tma = Schedule.parse("fused:1:tma=1")
    assert str(tma) == "fused:1:tma=1" and tma.param("tma") == 1
    assert factor_key("ag_matmul", tma) == "ag_matmul fused:1:tma=1"
    assert factor_key("ag_matmul", Schedule.parse("fused:1")) == "ag_matmul fused:1"
    for bad in ("ce_push:1:tma=1", "fused:1:tma=2", "fused:1:tma_store=1", "fused:1:tma=1,tma_store=2"):
        with pytest.raises(ValueError, match="tma"):
            Schedule.parse(bad)
    assert Schedule.parse("fused:1:tma=1,tma_store=1").param("tma_store") == 1


def test_transfers_beside_gemms_take_the_calibrated_slowdown():
    # 2 ranks, ce_push:2 reduce-scatter and all-gather on a link as fast as a GEMM piece: a
    # transfer slowed by half beside the GEMMs shows in the pipeline, `sequential` (NCCL) does not move
    from torch_commopt.tuner.calibrate import _transfer_slowdown
    from torch_commopt.tuner.matmul.model import _gemm

    shape = RegionShape("matmul_rs", 8192, 4096, (8192,), 2, "bfloat16")
    base = dataclasses.replace(prior("NVIDIA H200", 2), overlap_slowdown=0.0)
    q = _gemm(shape, base, 2048)
    cal = dataclasses.replace(base, p2p=Link(alpha_s=0.0, bytes_per_s=2048 * 8192 * 2 / q))
    slowed = dataclasses.replace(cal, transfer_slowdown=0.5)
    # peer pieces q, q (pushes 1.5q each: the first lands at 2.5q, the second at 4q), own
    # pieces after the local copy of each landed partial; the last own piece ends at 5q + copy
    copy = cal.local_copy.time(2048 * 8192 * 2)
    rs = lambda c: predict(shape, Schedule("ce_push", 2), c, graphs=True).gpu_s  # noqa: E731
    assert rs(cal) == pytest.approx(4 * q + copy)
    assert rs(slowed) == pytest.approx(4 * q + copy + q)
    seq = Schedule("sequential")
    assert predict(shape, seq, slowed, graphs=True).gpu_s == predict(shape, seq, cal, graphs=True).gpu_s
    # all-gather on a link twice as slow as a GEMM piece: the pipeline is the pushes'
    ag = RegionShape("ag_matmul", 4096, 4096, (8192,), 2, "bfloat16")
    slow = Link(alpha_s=0.0, bytes_per_s=2048 * 4096 * 2 / (2 * _gemm(ag, base, 2048)))
    ag_time = lambda x: predict(ag, Schedule("ce_push", 2), dataclasses.replace(  # noqa: E731
        base, p2p=slow, transfer_slowdown=x), graphs=True).gpu_s
    assert ag_time(0.5) - ag_time(0.0) == pytest.approx(0.5 * 2 * slow.time(2048 * 4096 * 2))  # two pushes in series
    assert _transfer_slowdown(1.5e-4, 1e-4) == pytest.approx(0.5)
    assert _transfer_slowdown(0.9e-4, 1e-4) == 0.0 and _transfer_slowdown(1.0, 1e-4) == 2.0  # clamped


def test_float8_regions_gemm_at_twice_the_bf16_rate_and_reduce_the_bf16_product():
    # calibration measures no float8 GEMM: a float8 region's GEMM is the bf16 fit at 2x; an
    # all-gather moves its 1-byte operand, a reduction its bf16 product (kernels/scaled.py)
    bf, f8 = "bfloat16", "float8_e4m3fn"
    rs_bf, rs_f8 = (RegionShape("matmul_rs", 8192, 4096, (8192,), 2, d) for d in (bf, f8))
    assert rs_f8.scaled and not rs_bf.scaled and rs_f8.out_elt == rs_bf.out_elt == 2 and rs_f8.elt == 1
    assert extra_bytes(rs_f8, Schedule("ce_push", 2)) == extra_bytes(rs_bf, Schedule("ce_push", 2))
    seq_bf, seq_f8 = (predict(s, Schedule("sequential"), H200) for s in (rs_bf, rs_f8))
    gemm_bf = predict(dataclasses.replace(rs_bf, world=1), Schedule("sequential"), H200).gpu_s
    gemm_f8 = predict(dataclasses.replace(rs_f8, world=1), Schedule("sequential"), H200).gpu_s
    assert gemm_f8 == pytest.approx(gemm_bf / 2, rel=1e-6)
    assert seq_bf.gpu_s - gemm_bf == pytest.approx(seq_f8.gpu_s - gemm_f8, rel=1e-6)  # the same reduce-scatter
    ag_bf, ag_f8 = (RegionShape("ag_matmul", 4096, 8192, (4096,), 2, d) for d in (bf, f8))
    assert extra_bytes(ag_f8, Schedule("chunked", 2)) * 2 == extra_bytes(ag_bf, Schedule("chunked", 2))
    # no float8 product in the fused kernels or ce_pull: not ranked
    names = {s.name for s in candidates(rs_f8, H200)}
    assert "ce_pull" not in names and "fused" not in names and "ce_pull" in {s.name for s in candidates(rs_bf, H200)}


def test_replayed_predictions_take_the_replay_timed_curve():
    # an eager long probe partly host-bound charges host time as device time (s39: matmul_ar
    # ce_push:4 at 1.70); replayed calls take the curve whose long probe was replayed too
    eager = [[2e-4, 1.55], [7e-4, 1.70]]
    replayed = [[2e-4, 1.55], [7e-4, 1.10]]
    cal = dataclasses.replace(prior("NVIDIA H200", 2), schedule_factor={"matmul_ar ce_push:4": 1.70},
                              schedule_factor_curve={"matmul_ar ce_push:4": eager},
                              schedule_factor_curve_graphs={"matmul_ar ce_push:4": replayed,
                                                            "matmul_ar ce_push": [[2e-4, 1.2], [7e-4, 1.3]]})
    assert cal.factor("matmul_ar ce_push:4", 1e-3) == pytest.approx(1.70)
    assert cal.factor("matmul_ar ce_push:4", 1e-3, graphs=True) == pytest.approx(1.10)
    assert cal.factor("matmul_ar ce_push:2", 1e-3, graphs=True) == pytest.approx(1.3)  # the family's
    assert cal.factor("matmul_rs ce_push:2", 1e-3, graphs=True) == 1.0  # neither curve knows it
    assert Calibration.from_json(cal.to_json()) == cal
    shape = RegionShape("matmul_ar", 8192, 8192, (8192,), 2)
    bare = dataclasses.replace(cal, schedule_factor={}, schedule_factor_curve={}, schedule_factor_curve_graphs={})
    raw = predict(shape, Schedule("ce_push", 4), bare, graphs=True).gpu_s
    assert predict(shape, Schedule("ce_push", 4), cal, graphs=True).gpu_s == pytest.approx(raw * 1.10)
    raw_eager = predict(shape, Schedule("ce_push", 4), bare).gpu_s
    assert predict(shape, Schedule("ce_push", 4), cal).gpu_s == pytest.approx(raw_eager * 1.70)
    # a calibration stored before the replayed curve existed predicts as it did
    old = json.loads(cal.to_json())
    del old["schedule_factor_curve_graphs"]
    assert Calibration.from_json(json.dumps(old)).factor("matmul_ar ce_push:4", 1e-3, graphs=True) == pytest.approx(1.70)


def test_per_call_graphs_take_the_replayed_factor_times_their_measured_slowdown():
    # ten sessions of sweeps (s46): at AR M_global 2048 per-call graphs ran ce_pull:2 15% slower
    # than whole-graph replays and ce_push:2 7%, so the replayed ranking put ce_pull:2 first
    # where ce_push:2 was the best; the calibration now measures that slowdown per schedule
    from torch_commopt.tuner.calibration import PER_CALL

    cal = dataclasses.replace(prior("NVIDIA H200", 2),
                              schedule_factor_curve_graphs={"matmul_ar ce_pull": [[2e-4, 1.1], [7e-4, 1.2]]},
                              call_graph_slowdown={"matmul_ar ce_pull:2": 1.15, "matmul_ar ce_push": 1.07})
    assert cal.factor("matmul_ar ce_pull:2", 2e-4, graphs=PER_CALL) == pytest.approx(1.1 * 1.15)
    assert cal.factor("matmul_ar ce_push:4", 2e-4, graphs=PER_CALL) == pytest.approx(1.07)  # the family's
    assert cal.factor("matmul_rs ce_push:2", 2e-4, graphs=PER_CALL) == 1.0  # not measured: as replayed
    # a schedule whose family was left out takes its op's median (s47: not 1.0, ranked ahead)
    op_level = dataclasses.replace(cal, call_graph_slowdown={**cal.call_graph_slowdown, "matmul_ar": 1.09})
    assert op_level.factor("matmul_ar direct:1", 2e-4, graphs=PER_CALL) == pytest.approx(1.09)
    assert op_level.factor("matmul_ar ce_push:4", 2e-4, graphs=PER_CALL) == pytest.approx(1.07)  # family first
    assert cal.factor("matmul_ar ce_pull:2", 2e-4, graphs=True) == pytest.approx(1.1)  # replayed: no slowdown
    assert Calibration.from_json(cal.to_json()) == cal
    shape = RegionShape("matmul_ar", 2048, 8192, (8192,), 2)
    for s in (Schedule("ce_pull", 2), Schedule("ce_push", 2)):
        replayed, per_call = predict(shape, s, cal, graphs=True), predict(shape, s, cal, graphs=PER_CALL)
        assert per_call.host_s == 0 and per_call.gpu_s > replayed.gpu_s
    # replayed, the prior ranks ce_push:2 2% ahead; a 10% per-call slowdown of it alone flips that
    even = dataclasses.replace(prior("NVIDIA H200", 2), call_graph_slowdown={"matmul_ar ce_push:2": 1.1})
    pull, push = Schedule("ce_pull", 2), Schedule("ce_push", 2)
    assert [p.schedule for p in rank(shape, even, [pull, push], graphs=True)] == [push, pull]
    assert [p.schedule for p in rank(shape, even, [pull, push], graphs=PER_CALL)] == [pull, push]
    # a calibration stored before the slowdown was measured ranks per-call regions as replayed
    old = json.loads(even.to_json())
    del old["call_graph_slowdown"]
    past = Calibration.from_json(json.dumps(old))
    assert ([p.seconds for p in rank(shape, past, [pull, push], graphs=PER_CALL)]
            == [p.seconds for p in rank(shape, past, [pull, push], graphs=True)])


def test_call_graph_slowdown_is_per_call_over_replayed_on_the_same_probe():
    from torch_commopt.tuner.probe_factors import _call_graph_slowdown

    replayed = {"matmul_ar ce_push:2": 2e-4, "matmul_ar ce_pull:2": 2e-4, "matmul_ar ce_push:4": 3e-4,
                "matmul_ar direct:1": 2e-4}
    per_call = {"matmul_ar ce_push:2": 2.14e-4, "matmul_ar ce_pull:2": 2.3e-4, "matmul_ar ce_push:4": 3.3e-4,
                "matmul_ar direct:1": 3.8e-4}  # 1.9x (2x H100, s47: a host-bound figure): left out
    out = _call_graph_slowdown(per_call, replayed)
    assert out["matmul_ar ce_push:2"] == pytest.approx(1.07) and out["matmul_ar ce_pull:2"] == pytest.approx(1.15)
    assert out["matmul_ar ce_push"] == pytest.approx(1.07)  # the family's first probe stands for it
    assert out["matmul_ar ce_push:4"] == pytest.approx(1.1)
    assert not any(k.startswith("matmul_ar direct") for k in out)
    assert out["matmul_ar"] == pytest.approx(1.1)  # the op's median: what direct:1 is ranked with
    assert _call_graph_slowdown({"matmul_rs ce_push:1": 1e-4}, {}) == {}  # nothing replayed to compare with


def test_the_per_call_probes_counters_are_summed_over_streams():
    from torch_commopt.tuner.probe_factors import _call_graph_counts

    stats = {"0:0x1": {"eager": 2, "captured": 2, "replayed": 50}, "1:0x2": {"eager": 1, "replayed": 7}}
    assert _call_graph_counts(stats) == {"eager": 3, "captured": 2, "replayed": 57}
    assert _call_graph_counts({}) == {}


def test_per_call_probes_time_the_capturable_gpu_schedules_with_cg():
    from torch_commopt.tuner.probe_factors import PROBE_SCHEDULES, _probed, _with_per_call_graph

    rs = [s for s in PROBE_SCHEDULES["matmul_rs"] if _probed("matmul_rs", Schedule.parse(s), False, True)]
    assert "ce_pull:2" in rs and "ce_push:1" in rs
    assert not {"sequential", "chunked:2", "fused:2"} & set(rs)  # not GPU, or another schedule once captured
    assert "sequential" in [s for s in PROBE_SCHEDULES["matmul_rs"] if _probed("matmul_rs", Schedule.parse(s), True, False)]
    seen = []
    _with_per_call_graph(seen.append, "matmul_ar", "ce_pull:2")
    assert [Schedule.parse(s) for s in seen] == [Schedule.parse("ce_pull:2").with_params(cg=1)]


def test_the_second_stream_all_gather_is_a_candidate_with_its_own_factor():
    # ce_push:1:par=1 (the rule's pick for two-rank all-gathers of 0.5-3 ms, replayed from 0.1):
    # the same device-time pipeline as ce_push:1 (two GEMMs beside each other share the SMs), so
    # its probed factor alone tells them apart
    from torch_commopt.tuner.matmul.model import factor_key
    from torch_commopt.tuner.probe_factors import PROBE_SCHEDULES

    par = Schedule.parse("ce_push:1:par=1")
    shape = RegionShape("ag_matmul", 4096, 8192, (4096,), 2, "bfloat16")
    assert par in candidates(shape, H200) and par in candidates(shape, H200, graphs=True)
    assert not any(s.param("par") for s in candidates(RegionShape("matmul_rs", 8192, 4096, (8192,), 2), H200))
    assert not any(s.param("par") for s in candidates(RegionShape("ag_matmul", 4096, 64, (64,), 2), prior("cpu", 2)))
    assert factor_key("ag_matmul", par) == "ag_matmul ce_push:1:par=1" and "ce_push:1:par=1" in PROBE_SCHEDULES["ag_matmul"]
    plain = predict(shape, Schedule("ce_push", 1), H200, graphs=True).gpu_s
    assert predict(shape, par, H200, graphs=True).gpu_s == pytest.approx(plain)  # no factor: the same pipeline
    cal = dataclasses.replace(H200, schedule_factor={"ag_matmul ce_push": 1.10, "ag_matmul ce_push:1:par=1": 1.05})
    assert predict(shape, par, cal).gpu_s == pytest.approx(plain * 1.05)
    assert rank(shape, cal, [Schedule("ce_push", 1), par])[0].schedule == par
    # eager, par=1 pays its own probed host figure (the second stream's fork and join) where
    # the calibration has one; a calibration without it charges ce_push's
    from torch_commopt.tuner.calibrate import HOST_PROBES, _host_families

    assert ("ag_matmul", "ce_push:1:par=1") in HOST_PROBES["cuda"]
    fam, _ = _host_families({"ag_matmul ce_push:1": 150e-6, "ag_matmul ce_push:1:par=1": 210e-6}, 2, 0.0)
    assert fam["ag_matmul ce_push"] == 150e-6 and fam["ag_matmul ce_push:par=1"] == 210e-6
    short = RegionShape("ag_matmul", 1024, 8192, (4096,), 2, "bfloat16")  # ~0.2 ms of GEMM: host-bound eagerly
    with_par = dataclasses.replace(H200, host_s={**H200.host_s, **fam}, host_per_piece_s=0.0)
    assert predict(short, par, with_par).host_s == pytest.approx(210e-6)
    assert predict(short, Schedule("ce_push", 1), with_par).host_s == pytest.approx(150e-6)
    assert predict(short, par, H200).host_s == predict(short, Schedule("ce_push", 1), H200).host_s
    assert predict(short, par, with_par, graphs=True).host_s == 0.0


def test_fused_host_cost_is_probed_and_keeps_fused_off_host_bound_shapes():
    # 2x H100 (s48): AG / RS M_global 512 fused:1 ran 0.35-0.42 ms a call eagerly (~0.1 ms of GPU);
    # unprobed, fused took the prior's 160 us and ranked first where sequential's host read 175 us
    from torch_commopt.tuner.calibrate import HOST_PROBES, _host_families

    assert {("ag_matmul", "fused:1"), ("matmul_rs", "fused:1")} <= set(HOST_PROBES["cuda"])
    hosts = {"ag_matmul sequential": 175e-6, "ag_matmul fused:1": 380e-6, "matmul_rs fused:1": 400e-6}
    fam, _ = _host_families(hosts, 2, 25e-6)
    cal = dataclasses.replace(H200, host_s={**H200.host_s, **fam})
    shape = RegionShape("ag_matmul", 256, 8192, (4096,), 2)
    fused, seq = (predict(shape, Schedule.parse(s), cal) for s in ("fused:1", "sequential"))
    assert fused.host_s == pytest.approx(380e-6) and fused.seconds > seq.seconds
    assert cal.host("fused", "matmul_rs") == pytest.approx(400e-6)


def test_sm90_fused_calls_pay_their_own_probed_host_cost_and_else_the_fused_figure():
    """A fused call with impl=sm90 is replayed (one native launch), a Triton one runs its Python:
    each pays its own probed figure; a calibration without the sm90 probe charges fused's."""
    from torch_commopt.tuner.calibrate import HOST_PROBES, _host_families

    assert {("ag_matmul", "fused:1:impl=sm90"), ("matmul_rs", "fused:1:impl=sm90")} <= set(HOST_PROBES["cuda"])
    hosts = {"ag_matmul fused:1": 420e-6, "ag_matmul fused:1:impl=sm90": 150e-6}
    fam, _ = _host_families(hosts, 2, 25e-6)
    assert fam["ag_matmul fused"] == pytest.approx(420e-6) and fam["ag_matmul fused:impl=sm90"] == pytest.approx(150e-6)
    short = RegionShape("ag_matmul", 1024, 8192, (4096,), 2, "bfloat16")
    cal = dataclasses.replace(H200, host_s={**H200.host_s, **fam})
    sm90, triton = (predict(short, Schedule.parse(s), cal) for s in ("fused:1:impl=sm90", "fused:1"))
    assert sm90.host_s == pytest.approx(150e-6) and triton.host_s == pytest.approx(420e-6)
    older = dataclasses.replace(H200, host_s={**H200.host_s, "ag_matmul fused": 420e-6})
    assert predict(short, Schedule.parse("fused:1:impl=sm90"), older).host_s == pytest.approx(420e-6)


def test_small_message_times_interpolate_in_log_log_and_stop_at_the_largest_sample():
    cal = dataclasses.replace(H200, small_msg={"oneshot": [[65536.0, 8e-6], [4096.0, 4e-6]]})  # unsorted on purpose
    assert cal.small_message_time("oneshot", 1024) == 4e-6  # below the smallest: latency-bound
    assert cal.small_message_time("oneshot", 16384) == pytest.approx((4e-6 * 8e-6) ** 0.5)  # the log-log midpoint
    assert cal.small_message_time("oneshot", 65536) == pytest.approx(8e-6)
    assert cal.small_message_time("oneshot", 65537) is None  # past the table: the bandwidth models
    assert cal.small_message_time("twoshot", 4096) is None  # not measured
    assert Calibration.from_json(cal.to_json()).small_msg == {"oneshot": [[65536.0, 8e-6], [4096.0, 4e-6]]}


def test_replayed_small_all_reduces_rank_by_their_measured_latency():
    """A decoder's projection (8 rows, 64 KiB product), replayed: the low-latency schedules are
    candidates and the measured table orders them against NCCL, both ways; eager calls, float8
    products and products past the buffer keep to the other schedules."""
    shape = RegionShape("matmul_ar", 8, 2048, (4096,), 2)
    nbytes = 8 * 4096 * 2
    assert {"oneshot", "twoshot"} <= {str(s) for s in candidates(shape, H200, graphs=True)}
    assert not {"oneshot", "twoshot"} & {str(s) for s in candidates(shape, H200)}
    assert not {"oneshot", "twoshot"} & {str(s) for s in candidates(shape, H200, graphs="call")}  # per-call graphs
    fast_ll = dataclasses.replace(H200, small_msg={"sequential": [[nbytes, 20e-6]], "oneshot": [[nbytes, 5e-6]],
                                                   "twoshot": [[nbytes, 7e-6]]})
    assert [str(p.schedule) for p in rank(shape, fast_ll, graphs=True)[:2]] == ["oneshot", "twoshot"]
    slow_ll = dataclasses.replace(H200, small_msg={"sequential": [[nbytes, 5e-6]], "oneshot": [[nbytes, 20e-6]],
                                                   "twoshot": [[nbytes, 25e-6]]})
    best = rank(shape, slow_ll, graphs=True)[0]
    assert str(best.schedule) == "sequential"
    oneshot = predict(shape, Schedule("oneshot"), slow_ll, graphs=True)
    assert best.gpu_s - oneshot.gpu_s == pytest.approx(5e-6 - 20e-6)  # the same GEMM, the measured all-reduces
    assert oneshot.pool_bytes == 32 << 20 and oneshot.host_s == 0.0  # the buffer, held once per group
    big = RegionShape("matmul_ar", 4096, 2048, (4096,), 2)  # 32 MiB: past the buffer
    assert not {"oneshot", "twoshot"} & {str(s) for s in candidates(big, H200, graphs=True)}


def test_the_model_sizes_the_low_latency_buffer_as_the_kernels_do():
    pytest.importorskip("triton")
    from torch_commopt.kernels.gpu import lowlat, symm
    from torch_commopt.kernels.matmul.gpu import pick
    from torch_commopt.tuner.matmul import model

    assert model.LOWLAT_CAP_BYTES == lowlat.LL_CAP_BYTES and pick.LOWLAT_MAX_WORLD <= symm.MAX_WORLD


def test_the_cuda_kernels_are_candidates_of_bf16_all_gathers_and_reduce_scatters_only():
    sm90 = Schedule("fused", 1, (("impl", "sm90"),))
    for kind in ("ag_matmul", "matmul_rs"):
        assert sm90 in candidates(RegionShape(kind, 8192, 4096, (4096,), 2, "bfloat16"), H200)
        assert sm90 not in candidates(RegionShape(kind, 8192, 4096, (4096,), 2, "float16"), H200)
    assert not [c for c in candidates(RegionShape("matmul_ar", 8192, 4096, (4096,), 2, "bfloat16"), H200)
                if c.param("impl")]


def test_the_sm90_kernels_are_priced_by_their_own_efficiency_and_factor():
    """fused:1:impl=sm90 has its own factor key and GEMM efficiency (Calibration.sm90_efficiency),
    not the Triton kernels' (fused_efficiency, the `fused` family's factor); a kind the
    calibration has no sm90 figure for, or an older calibration without any, takes the Triton one."""
    from torch_commopt.tuner.matmul.model import factor_key, fused_efficiency

    sm90, triton = Schedule.parse("fused:1:impl=sm90"), Schedule.parse("fused:1")
    assert factor_key("matmul_rs", sm90) == "matmul_rs fused:1:impl=sm90"
    assert factor_key("matmul_rs", triton) == "matmul_rs fused:1"
    assert fused_efficiency("matmul_rs", sm90, H200) == H200.sm90_efficiency["matmul_rs"] > H200.fused_efficiency
    assert fused_efficiency("matmul_rs", triton, H200) == H200.fused_efficiency
    older = dataclasses.replace(H200, sm90_efficiency={})
    assert fused_efficiency("ag_matmul", sm90, older) == older.fused_efficiency
    for kind, ns in (("ag_matmul", (3072,)), ("matmul_rs", (4096,))):
        shape = RegionShape(kind, 8192, 4096, ns, 2, "bfloat16")
        fast, slow = predict(shape, sm90, H200).gpu_s, predict(shape, triton, H200).gpu_s
        assert fast < slow, (kind, fast, slow)
        # a measured factor of its own applies to it alone
        cal = dataclasses.replace(H200, schedule_factor={f"{kind} fused": 1.4, f"{kind} fused:1:impl=sm90": 1.05})
        assert predict(shape, sm90, cal).gpu_s == pytest.approx(fast * 1.05)
        assert predict(shape, triton, cal).gpu_s == pytest.approx(slow * 1.4)
    back = Calibration.from_json(H200.to_json())
    assert back.sm90_efficiency == H200.sm90_efficiency
    raw = json.loads(H200.to_json())
    del raw["sm90_efficiency"]  # a calibration stored before the field
    assert Calibration.from_json(json.dumps(raw)).sm90_efficiency == {}


def test_the_sm90_reduce_scatter_pays_its_partials_by_their_bytes_not_its_k():
    """The own segment's partials cost (W - 1) x its bytes / Calibration.sm90_partial_bytes_per_s
    on top of the GEMM, whatever K is (one H200: 11 us at wo's K 2048 and at w2's K 7168 alike),
    and nothing for the other schedules or kinds; a calibration stored before the field
    charges nothing."""
    sm90, triton = Schedule.parse("fused:1:impl=sm90"), Schedule.parse("fused:1")
    free = dataclasses.replace(H200, sm90_partial_bytes_per_s=0.0, schedule_factor={}, schedule_factor_curve={})
    paid = dataclasses.replace(free, sm90_partial_bytes_per_s=3.0e12)
    for world in (2, 4):
        seg_bytes = 8192 // world * 4096 * 2
        for k in (2048, 7168):
            shape = RegionShape("matmul_rs", 8192, k, (4096,), world, "bfloat16")
            extra = predict(shape, sm90, paid).gpu_s - predict(shape, sm90, free).gpu_s
            assert extra == pytest.approx((world - 1) * seg_bytes / 3.0e12), (world, k)
            assert predict(shape, triton, paid).gpu_s == predict(shape, triton, free).gpu_s
    ag = RegionShape("ag_matmul", 4096, 4096, (4096,), 2, "bfloat16")
    assert predict(ag, sm90, paid).gpu_s == predict(ag, sm90, free).gpu_s
    raw = json.loads(H200.to_json())
    del raw["sm90_partial_bytes_per_s"]
    assert Calibration.from_json(json.dumps(raw)).sm90_partial_bytes_per_s == 0.0


def test_the_probes_give_the_sm90_kernels_their_weight_k_major(monkeypatch):
    """The probe's weight is (K, N) row-major; the sm_90a kernels refuse it (and would run the
    Triton kernel under their name), so their schedules get the same values K-major."""
    from torch_commopt.tuner import probe_factors

    seen = []
    monkeypatch.setattr(probe_factors, "runner", lambda kind, a, ws, world, group: lambda s: seen.append((s, ws[0])))
    w = torch.randn(64, 32)
    run = probe_factors._probe_runner("matmul_rs", torch.randn(16, 64), w, 2, "g")
    run("fused:1:impl=sm90")
    run("fused:2")
    (sm90, kmajor), (triton, plain) = seen
    assert sm90 == "fused:1:impl=sm90" and kmajor.stride(0) == 1 and torch.equal(kmajor, w)
    assert triton == "fused:2" and plain is w
    assert "fused:1:impl=sm90" in probe_factors.PROBE_SCHEDULES["matmul_rs"]
    assert "fused:1:impl=sm90" in probe_factors.PROBE_SCHEDULES["ag_matmul"]
