"""benchmarks/bench_meshslice.py --simulate: the report's rows come from the simulator (no GPU)."""

import json
import sys


def test_the_simulation_report_has_every_machine_model_and_algorithm(tmp_path, monkeypatch):
    from benchmarks import bench_meshslice

    monkeypatch.setattr(sys, "argv", ["bench_meshslice", "--simulate", "--out", str(tmp_path), "--commit", "test"])
    bench_meshslice.main()
    (report,) = tmp_path.glob("meshslice_sim_*.json")
    data = json.loads(report.read_text())
    assert len(data["tpu"]) == 4 and len(data["gpu"]) == 6
    for row in data["tpu"] + data["gpu"]:
        assert set(row["results"]) == {"meshslice", "collective", "summa", "wang"}
    for row in data["tpu"]:  # the whole block: the FC layers plus the same local rest for every algorithm
        rest, fc = row["rest_of_block_s"], {a: r["seconds"] for a, r in row["results"].items()}
        assert 0 < rest < 0.1 * fc["meshslice"]
        assert all(abs(row["block_s"][a] - (fc[a] + rest)) < 1e-12 for a in fc)
        fc_gain = fc["wang"] / fc["meshslice"]
        assert 1 < row["block_s"]["wang"] / row["block_s"]["meshslice"] < fc_gain  # diluted, not reversed
    sim_gpt3 = next(r for r in data["tpu"] if r["machine"] == "simulation figures" and r["model"] == "gpt3-175b")
    assert sim_gpt3["analytic"]["mesh"] == [64, 4]  # the authors' simulation tuner's pick
    assert "| 256 | megatron-nlg-530b |" in (tmp_path / report.name.replace(".json", ".md")).read_text()
    # 1D TP + FSDP beside 1D TP + DP, and at fewer tokens a GPU (4 sizes x 2 cluster sizes x 2 models)
    assert all(row["tp_fsdp_s"] >= row["tp_dp_s"] - 1e-12 for row in data["gpu"])
    assert len(data["gpu_batch"]) == 16 and {r["tokens_a_gpu"] for r in data["gpu_batch"]} == {2048, 1024, 512, 256}


def test_the_measured_mode_runs_every_algorithm_on_a_2x2_gloo_mesh(capsys, monkeypatch):
    from benchmarks import bench_meshslice

    monkeypatch.setattr(sys, "argv", ["bench_meshslice", "--measure", "--cpu", "--rounds", "1"])
    bench_meshslice.main()
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| in_proj", "| out_proj",
                                                                                       "| ff1", "| ff2"))]
    assert [line.split(" | ")[1] for line in table] == ["os", "ls", "os", "ls"], table
