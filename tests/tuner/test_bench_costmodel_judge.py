"""bench_costmodel's paired judge of autotune's pick and the summary lines it feeds."""

from benchmarks import bench_costmodel


def _duel(factors, times):
    """Rows of a head-to-head: every round's clock factor times each schedule's true ms."""
    return [(r, s, ms * f) for r, f in enumerate(factors) for s, ms in times.items()]


def test_a_pick_slower_in_every_round_is_slower_even_when_clocks_wander():
    factors = [1.0 + 0.08 * ((r * 7) % 5) for r in range(25)]  # 0-32% swings between rounds
    rows = _duel(factors, {"pick": 1.02, "best": 1.00})
    j = bench_costmodel.judge(rows, "pick")
    assert not j["held"] and abs(j["worst_median"] - 1.02) < 1e-9
    assert bench_costmodel.judge(rows, "best")["held"]


def test_a_tie_within_the_noise_holds():
    import random

    rng = random.Random(0)
    rows = [(r, s, 1.0 + rng.gauss(0, 0.02)) for r in range(25) for s in ("pick", "other")]
    j = bench_costmodel.judge(rows, "pick")
    v = j["versus"]["other"]
    assert v["lo"] <= v["median"] <= v["hi"] and v["rounds"] == 25
    assert j["held"] == (v["lo"] <= 1.0)
    assert bench_costmodel.judge([(0, "pick", 1.0)], "pick") == {"versus": {}, "held": True, "worst_median": 1.0}


def test_summary_counts_both_reads_and_the_one_the_tuner_runs(monkeypatch):
    held = {"judged": {"median": {"held": True, "worst_median": 1.0}, "paired": {"held": True, "worst_median": 1.0}}}
    slow = {"judged": {"median": {"held": False, "worst_median": 1.04}, "paired": {"held": True, "worst_median": 0.99}}}
    shapes = []
    for verdict in (held, slow):
        shapes.append(dict(verdict, op="ag", M=512, N=8192, model_top1="a", measured_best="a", measured_best_ms=1.0,
                           model_top1_measured_ms=1.0, autotune_pick="a", autotune_pick_measured_ms=1.0,
                           autotune_timing_ms={"a": 1.0}, head_to_head_ms={}))
    records = [{"op": "ag", "M": 512, "N": 8192, "candidate": "a", "predicted_ms": 1.0, "measured_ms": 1.0}]
    compile_ = {k: {"seconds": 1.0, "regions": 2} for k in ("auto", "autotune_cold", "autotune_warm", "auto_again")}
    result = {"records": records, "shapes": shapes, "compile": compile_, "calibration_s": 1.0}
    for paired, judged in ((False, "1/2"), (True, "2/2")):
        monkeypatch.setattr(bench_costmodel, "PAIRED", paired)
        got = bench_costmodel.summarize(result)
        assert got["autotune_reads"] == ("paired" if paired else "median")
        assert got["autotune_is_a_measured_best_paired_judge"] == judged
        assert got["autotune_median_read_is_a_measured_best"] == "1/2"
        assert got["autotune_paired_read_is_a_measured_best"] == "2/2"
        assert got["autotune_pick_worst_paired_ratio"] == (1.0 if paired else 1.04)


def test_summary_counts_the_misses_a_second_head_to_head_found_again():
    def shape(held, again):
        return dict(op="ag", M=512, N=8192, model_top1="a", measured_best="b", measured_best_ms=1.0,
                    model_top1_measured_ms=1.0, autotune_pick="a", autotune_pick_measured_ms=1.01,
                    autotune_timing_ms={"a": 1.0}, head_to_head_ms={},
                    judged={h: {"held": held, "versus": {}, "worst_median": 1.0} for h in ("median", "paired")},
                    judged_again=None if again is None else {"held": again, "versus": {}, "worst_median": 1.0})

    shapes = [shape(True, None), shape(False, False), shape(False, True), shape(False, True)]
    records = [{"op": "ag", "M": 512, "N": 8192, "candidate": "a", "predicted_ms": 1.0, "measured_ms": 1.0}]
    compile_ = {k: {"seconds": 1.0, "regions": 2} for k in ("auto", "autotune_cold", "autotune_warm", "auto_again")}
    got = bench_costmodel.summarize({"records": records, "shapes": shapes, "compile": compile_, "calibration_s": 1.0})
    assert got["autotune_judge_misses_reproduced"] == "1/3"
    assert "again: " in bench_costmodel._verdict(dict(shapes[1], autotune_picks={"median": "a", "paired": "a"}))
