"""benchmarks/bench_flex.py: its CPU/gloo smoke (every variant runs and agrees with the single
device's attention) and the figures it derives from raw times."""

import json
import pathlib

import pytest

from benchmarks import bench_flex


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_variant_and_each_agrees_with_one_device():
    (record,) = bench_flex.main(["--cpu", "--masks", "docs 128", "--seq", "512", "--repeats", "1"])
    names = set(record["ms"])
    assert {"single GPU", "torch CP head_tail", "torch CP ptrr"} <= names
    for layout in ("contiguous", "by_work"):  # documents: choose deals the blocks by work
        assert {f"commopt {s} @ {layout}" for s in ("ring", "allgather", "allgather:g=2")} <= names
    tiles = record["tiles"]
    assert record["layout"] == "by_work" and max(tiles["by_work"]) <= max(tiles["contiguous"]), tiles
    assert max(record["errors"].values()) < 1e-5, record["errors"]


def test_efficiency_and_speedup_come_from_the_times():
    r = {"ms": {"single GPU": 10.0, "commopt allgather @ by_work": 6.0, "commopt ring @ by_work": 5.0,
                "torch CP head_tail": 9.0, "torch CP ptrr": 7.5},
         "tiles": {"contiguous": [1, 3], "by_work": [2, 2]}, "pick": "allgather", "errors": {"x": 1e-3}}
    (d,) = bench_flex.derive([r], 2)
    assert d["commopt_ms"] == 6.0 and d["best_commopt"] == "commopt ring @ by_work"
    assert d["efficiency"] == pytest.approx(10 / 12) and d["speedup_vs_torch_cp"] == pytest.approx(7.5 / 6)
    assert d["torch_cp_efficiency"] == pytest.approx(10 / 15)


def test_the_profile_section_lists_every_rank_of_every_profiled_variant():
    prof = {"attention": 4.5, "nccl": 0.3, "gpu_busy": 5.0, "gpu_span": 5.4, "kernels": {"flex_fwd": [1.2, 1.0]},
            "idle_gaps": {"idle_ms": 0.4, "gaps": 3}}
    r = {"mask": "causal", "seq": 16384, "profile": {"commopt allgather @ head_tail": [prof, prof]}}
    lines = bench_flex.profile_lines([r, {"mask": "docs 1K", "seq": 16384}])  # the second was not profiled
    rows = [line for line in lines if line.startswith("- ")]
    assert [row.split(":")[0] for row in rows] == ["- commopt allgather @ head_tail, rank 0",
                                                   "- commopt allgather @ head_tail, rank 1"]
    assert "gpu_span 5.4" in rows[0] and "idle 0.4 ms in 3 gaps" in rows[0] and "flex_fwd 1.2 (x1)" in rows[0]
    assert bench_flex.profile_lines([{"mask": "causal", "seq": 1}]) == []


def test_a_run_off_the_defaults_is_a_report_of_its_own():
    assert bench_flex.report_variant(bench_flex.parse_args([])) == ""
    args = bench_flex.parse_args(["--schedule", "allgather:g=2", "--layout", "contiguous", "--whole-mask"])
    assert bench_flex.report_variant(args) == "allgather-g2_contiguous_whole"
    assert bench_flex.report_variant(bench_flex.parse_args(["--pulled"])) == "pulled"


def test_k_v_move_on_the_copy_engine_by_default_and_an_nccl_run_is_a_report_of_its_own(monkeypatch):
    monkeypatch.delenv("TORCH_COMMOPT_ATTENTION_TRANSPORT", raising=False)
    assert bench_flex.report_variant(bench_flex.parse_args([])) == ""
    monkeypatch.setenv("TORCH_COMMOPT_ATTENTION_TRANSPORT", "ce")
    assert bench_flex.report_variant(bench_flex.parse_args([])) == ""
    monkeypatch.setenv("TORCH_COMMOPT_ATTENTION_TRANSPORT", "nccl")
    assert bench_flex.report_variant(bench_flex.parse_args(["--layout", "contiguous"])) == "contiguous_nccl"
    meta = {"world": 2, "device": "GPU", "commit": "abc", "date": "d", "torch": "t", "dtype": "bfloat16", "heads": "32/8",
            "head_dim": 128, "repeats": 5, "transport": "ce"}
    assert "K/V moved by the copy engine" in bench_flex.report([], meta)
    assert "copy engine" not in bench_flex.report([], {**meta, "transport": "nccl"})


def _record(mask: str, seq: int, commopt: float) -> dict:
    ms = {"single GPU": 2 * commopt, "commopt allgather @ by_work": commopt, "torch CP ptrr": 1.1 * commopt}
    return bench_flex.derive([{"mask": mask, "seq": seq, "ms": ms, "errors": {"x": 1e-3}, "tiles": {"by_work": [1, 1]},
                               "pick": "allgather"}], 2)[0]


def test_join_writes_one_report_of_several_runs(tmp_path):
    meta = {"world": 2, "device": "NVIDIA H200", "commit": "abc", "date": "2026-11-30", "torch": "t",
            "dtype": "bfloat16", "heads": "32/8", "head_dim": 128, "repeats": 5, "transport": "ce", "command": "run"}
    paths = []
    for i, (seq, commopt) in enumerate([(16384, 2.0), (32768, 4.0)]):
        path = tmp_path / f"run{i}" / "flex_cp_h200x2_2026-11-30.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**meta, "commit": f"c{i}", "records": [_record("causal", seq, commopt)]}))
        paths.append(str(path))
    text = bench_flex.join(paths, str(tmp_path / "out"))
    rows = [line for line in text.splitlines() if line.startswith("| causal")]
    assert [row.split(" | ")[1] for row in rows] == ["16384", "32768"]
    joined = json.loads((tmp_path / "out" / "flex_cp_h200x2_2026-11-30.json").read_text())
    assert joined["commit"] == "c0/c1" and len(joined["records"]) == 2
    pathlib.Path(paths[1]).write_text(json.dumps({**meta, "transport": "nccl", "records": []}))
    with pytest.raises(SystemExit, match="transport"):
        bench_flex.join(paths, None)


@pytest.mark.slow
def test_the_cpu_smoke_runs_the_ring_with_the_whole_mask_on_the_contiguous_layout():
    """Documents dealt contiguously, every rank given the whole mask: the ring sends each rank the
    span of keys it needs (flex_ring.DirectShift) and agrees with one device."""
    (record,) = bench_flex.main(["--cpu", "--masks", "docs 128", "--seq", "512", "--repeats", "1", "--pick-only",
                                 "--schedule", "ring", "--layout", "contiguous", "--whole-mask"])
    assert set(record["ms"]) >= {"single GPU", "commopt ring @ contiguous"} and record["layout"] == "contiguous"
    assert max(record["errors"].values()) < 1e-5, record["errors"]


@pytest.mark.slow
def test_pulled_adds_the_one_group_all_gather_with_its_cut_gather_asked_for(monkeypatch):
    """On the CPU nothing is pulled (gloo, no copy engine): the variant runs, agrees, and asks for the
    switch during its calls only."""
    from torch_commopt.core import env

    monkeypatch.delenv(env.FLEX_GATHER_CUT, raising=False)
    (record,) = bench_flex.main(["--cpu", "--masks", "docs 128", "--seq", "512", "--repeats", "1", "--pick-only",
                                 "--schedule", "allgather", "--pulled"])
    assert {"commopt allgather @ by_work", "commopt allgather pulled @ by_work"} <= set(record["ms"])
    assert max(record["errors"].values()) < 1e-5, record["errors"]
    seen = []
    bench_flex._pulled(lambda: seen.append(env.flex_gather_cut()))()
    assert seen == [True] and not env.flex_gather_cut()


def test_the_host_section_lists_every_variant_s_host_time_by_rank():
    host = {"single GPU": [1.0, 0.96], "commopt allgather @ by_work": [2.69, 2.51]}
    records = [{"mask": "docs 1K", "seq": 16384, "host_ms": host}]
    lines = bench_flex.host_lines(records)
    assert lines[1].startswith("## Host ms a call")
    assert lines[-1] == "- docs 1K S 16384: single GPU 1.00 / 0.96; commopt allgather @ by_work 2.69 / 2.51"
    assert bench_flex.host_lines([{"mask": "causal", "seq": 1}]) == []
    assert bench_flex.parse_args(["--host", "10"]).host == 10
