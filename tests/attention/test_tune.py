"""Config.mode="autotune" for context-parallel attention: measured by `tune --attention`, taken
from the tuner cache by the rewrite (tuner/attention/tune.py), gloo."""

from __future__ import annotations

import json

import pytest
from compiled_programs import close

from torch_commopt.core.attention_spec import AttentionShape
from torch_commopt.testing.launch import run_distributed
from torch_commopt.tuner.attention import tune

# compiled_programs.compiled_cp's program: global q (2, 4, 16, 16), k/v with 2 heads (GQA)
SHAPE = "2,4,2,16,16"


def test_candidates_add_the_other_head_group_depths_and_the_reference():
    ranked = [("ulysses", 1.0), ("ring", 2.0), ("ring_zigzag", 3.0), ("allgather", 4.0)]
    big = AttentionShape(1, 32, 32, 16384, 128)  # 64 MiB of bf16 q per rank at W=2: the rule gives ulysses 2 groups
    assert tune.timed_candidates(ranked, big, 2, True, "bfloat16", 2) == ["ulysses", "ring", "ulysses:g=1", "allgather"]
    small = AttentionShape(1, 4, 4, 64, 8)  # the rule gives 1 group: g=2 is the other depth
    assert tune.timed_candidates(ranked, small, 2, True, "float32", 3) == [
        "ulysses", "ring", "ring_zigzag", "ulysses:g=2", "ring_zigzag:g=2", "allgather"]
    gqa = AttentionShape(1, 4, 2, 64, 8)  # Ulysses in 2 groups would split 2 kv heads over 4 parts: refused
    assert tune.timed_candidates(ranked, gqa, 2, True, "float32", 3) == [
        "ulysses", "ring", "ring_zigzag", "ring_zigzag:g=2", "allgather"]
    odd = AttentionShape(1, 3, 1, 64, 8)  # 3 heads, 1 kv head: no depth of 2 splits them
    assert tune.timed_candidates([("ring", 1.0), ("allgather", 2.0)], odd, 2, False, "float32", 1) == ["ring", "allgather"]


def test_attention_specs_are_parsed_and_bad_ones_refused():
    assert tune.parse_spec("1,32,8,16384,128:causal:train") == (AttentionShape(1, 32, 8, 16384, 128), True, True)
    assert tune.parse_spec(SHAPE) == (AttentionShape(2, 4, 2, 16, 16), False, False)
    with pytest.raises(ValueError, match="want B,H,HKV,S,D"):
        tune.parse_spec("1,32,8,16384")
    with pytest.raises(ValueError, match="unknown flag"):
        tune.parse_spec("1,32,8,16384,128:causl")
    with pytest.raises(ValueError, match="kv heads must divide"):
        tune.parse_spec("1,32,6,16384,128")


def _attention_entries(root) -> list:
    entries = [json.loads(p.read_text()) for p in root.glob("*.json")]
    return [(p, e) for p, e in zip(root.glob("*.json"), entries) if e["key"].get("question") == "attention"]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_autotune_runs_the_measured_schedule_from_the_cache(tmp_path, capsys, train):
    from compiled_programs import compiled_cp

    from torch_commopt.__main__ import main

    options = {"mode": "autotune", "cache_dir": str(tmp_path), "autotune_top_k": 2}
    # nothing measured yet: the model's pick runs, and explain says how to measure
    for errs, notes, _ in run_distributed(compiled_cp, 2, "bhsd", (4, 2), train, "auto", False, options):
        assert close(errs) and any("this shape was not measured" in n and "--attention " + SHAPE in n
                                  for n in notes), notes
    spec = SHAPE + (":train" if train else "")
    assert main(["tune", "--attention", spec, "--world", "2", "--backend", "gloo", "--top-k", "2",
                 "--cache-dir", str(tmp_path)]) == 0
    assert f"attention {spec}: " in capsys.readouterr().out
    [(path, entry)] = _attention_entries(tmp_path)
    assert entry["key"]["backward"] is train and set(entry["value"]["measured_ms"]) == set(entry["key"]["candidates"])
    # plant another candidate as the winner: the rewrite must run what the cache says, whatever the model thinks
    planted = next(c for c in reversed(entry["key"]["candidates"]) if c != entry["value"]["schedule"])
    entry["value"]["schedule"] = planted
    path.write_text(json.dumps(entry))
    for errs, notes, gathers in run_distributed(compiled_cp, 2, "bhsd", (4, 2), train, "auto", False, options):
        assert close(errs) and gathers == 0, (errs, notes)
        form = "cp_attention_fwd/bwd" if train else "cp_attention_fwd"
        assert any(f"{form} {planted} " in n and "measured: " in n and "(cached)" in n for n in notes), notes


def test_tune_refuses_a_sequence_the_world_does_not_split():
    from torch_commopt.cli import run_tune

    with pytest.raises(ValueError, match="not a multiple of --world 2"):
        run_tune([], 2, "gloo", attention=["1,4,4,15,8"])


def test_explain_attention_prints_the_ranking_with_the_cached_measurement(capsys, tmp_path):
    from torch_commopt.__main__ import main
    from torch_commopt.tuner.cache import TunerCache

    spec = "1,32,32,16384,128:causal:train"
    assert main(["explain", "--attention", spec, "--device", "NVIDIA H200", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "attention model: prior calibration of NVIDIA H200 x2, bfloat16"
    assert out[1].startswith(f"{spec} (forward + backward; model picks ") and "not measured" in out[1]
    rows = out[2:]
    times = [float(line.split()[1]) for line in rows]
    assert times == sorted(times) and {"ulysses", "ulysses:g=1", "allgather"} <= {r.split()[0] for r in rows}
    # a measurement in the cache (what `tune --attention` stores) is shown and named as autotune's choice
    from torch_commopt.tuner.attention.cost import machine_from_calibration
    from torch_commopt.tuner.calibration import prior

    shape, causal, backward = tune.parse_spec(spec)
    machine = machine_from_calibration(prior("NVIDIA H200", 2), "bfloat16")
    _, top, key = tune.question(shape, 2, causal, "bfloat16", backward, "NVIDIA H200", machine, 4)
    TunerCache(str(tmp_path)).put(key, {"schedule": "allgather", "measured_ms": {t: 9.0 for t in top}})
    assert main(["explain", "--attention", spec, "--device", "NVIDIA H200", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "autotune runs allgather (measured)" in out[1] and "9.000 ms measured" in out[2]
