"""bench_decode --step (benchmarks/decode_step.py) on CPU/gloo: a tiny decoder's shards are slices of
its full weights and cache; at 2 ranks every CPU variant runs, commopt rewrites every row-parallel
projection, and every variant agrees with the unsharded model within a bound set by that model's
own error against float64; and the report derives its figures from the raw times."""

import dataclasses
import os

import pytest
import torch

from benchmarks import decode_step
from torch_commopt.testing.launch import run_distributed
from torch_commopt.testing.validate import TOLERANCE_FACTOR


def _cpu_plan() -> decode_step.Plan:
    """Every CPU variant, one round of one step (the figures are not what is checked)."""
    return decode_step.Plan(mode="cpu", shape=decode_step.TINY, cases=decode_step.CPU_CASES,
                            variants=decode_step.VARIANTS["cpu"], rounds=1, steps=1)


def test_the_shards_are_slices_of_the_full_weights_and_cache():
    shape, case = decode_step.TINY, decode_step.CPU_CASES[0]
    full = decode_step.build(shape, decode_step.TP(0, 1), case, "cpu", torch.float32)
    hd = shape.head_dim
    for rank in range(2):
        part = decode_step.build(shape, decode_step.TP(rank, 2), case, "cpu", torch.float32)
        assert torch.equal(part.tok_embeddings, full.tok_embeddings) and torch.equal(part.output, full.output)
        for mine, whole in zip(part.layers, full.layers):
            q, kv = shape.heads * hd, shape.kv_heads * hd
            wq, wk, wv = whole.attention.wqkv.split([q, kv, kv])
            want = torch.cat([wq.chunk(2)[rank], wk.chunk(2)[rank], wv.chunk(2)[rank]])
            assert torch.equal(mine.attention.wqkv, want)
            assert torch.equal(mine.attention.wo, whole.attention.wo.chunk(2, 1)[rank])
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                assert torch.equal(getattr(mine.feed_forward, name), getattr(whole.feed_forward, name).chunk(2, dim)[rank])
            for cache in ("k_cache", "v_cache"):
                assert torch.equal(getattr(mine.attention, cache), getattr(whole.attention, cache).chunk(2, 1)[rank])


def test_the_bytes_a_step_reads_are_the_models_own():
    shape, case = decode_step.TINY, decode_step.CPU_CASES[0]
    model = decode_step.build(shape, decode_step.TP(1, 2), case, "cpu", torch.float32)
    weights = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.numel() + case.batch * shape.dim
    caches = sum(b.numel() for n, b in model.named_buffers() if n.endswith("_cache"))
    assert decode_step.step_bytes(shape, case, 2, 4) == (weights + caches) * 4


@pytest.mark.slow
def test_the_cpu_smoke_run_agrees_with_the_unsharded_model_in_every_variant():
    plan = _cpu_plan()
    (c,) = decode_step.derive(run_distributed(decode_step.rank_main, 2, plan, backend="gloo", timeout_s=300)[0][0])
    assert not c["not_run"] and set(c["ms"]) == set(plan.variants) and all(t > 0 for t in c["ms"].values())
    # every row-parallel projection (wo and w2 of each layer) rewritten, no collective left
    for v in ("commopt", "commopt gather_sum"):
        regions = c["regions"][v]
        assert regions["rewritten"] == 2 * plan.shape.layers and not regions["collectives_left"], regions
    assert c["regions"]["commopt gather_sum"]["schedules"] == ["matmul_ar gather_sum"]
    # the all-reduces each compiled program calls: c10d's, commopt's op, none in the bound
    ar = 2 * plan.shape.layers
    calls = c["collective_calls"]
    assert calls["inductor"] == {"nccl all_reduce": ar, "symm_mem one_shot": 0, "commopt matmul_ar": 0}
    for v in ("commopt", "commopt gather_sum"):
        assert calls[v] == {"nccl all_reduce": 0, "symm_mem one_shot": 0, "commopt matmul_ar": ar}
    assert calls[decode_step.BOUND] == {"nccl all_reduce": 0, "symm_mem one_shot": 0, "commopt matmul_ar": 0}
    assert calls["eager"] is None and calls["unsharded"] is None
    compared = [v for v in plan.variants if v != decode_step.BOUND]
    assert c["agree"] == {v: True for v in compared}, (c["max_abs_vs_truth"], c["allowed_error_vs_truth"])
    # world 2 against world 1: within the unsharded model's own float32 error (triangle inequality)
    own = max(c["max_abs_vs_truth"]["unsharded"], c["logit_scale"] * 2.0 ** -24)
    assert all(c["max_abs_vs_reference"][v] <= (TOLERANCE_FACTOR + 1) * own for v in compared), c["max_abs_vs_reference"]
    assert c["same_on_every_rank"]["commopt gather_sum"]


def _record(**changes) -> dict:
    """A case's raw figures as run_case gives them (two ranks' maxima), with `changes`."""
    record = {"batch": 8, "ctx": 4096, "bytes_per_step": int(4.8e9), "reference": "inductor+nccl", "logit_scale": 10.0,
              "ms": {"inductor+nccl": 10.0, "inductor+symm_mem": 9.0, "commopt": 8.0, "commopt oneshot": 7.5,
                     decode_step.BOUND: 6.0},
              "max_abs_vs_truth": {"inductor+nccl": 0.01, "inductor+symm_mem": 0.012, "commopt": 0.03,
                                   "commopt oneshot": 0.05, decode_step.BOUND: 50.0},
              "max_abs_vs_reference": {"inductor+nccl": 0.0, "inductor+symm_mem": 0.01, "commopt": 0.02,
                                       "commopt oneshot": 0.05, decode_step.BOUND: 50.0},
              "same_on_every_rank": {"inductor+nccl": True, "inductor+symm_mem": True, "commopt": True,
                                     "commopt oneshot": True, decode_step.BOUND: True},
              "compile_s": {}, "regions": {"commopt oneshot": {"rewritten": 64, "kept": 0,
                                                                 "schedules": ["matmul_ar oneshot"]}},
              "not_run": {}, "cudagraph_skips": {},
              "collective_calls": {"commopt oneshot": {"nccl all_reduce": 0, "symm_mem one_shot": 0,
                                                       "commopt matmul_ar": 64},
                                   decode_step.BOUND: {"nccl all_reduce": 0, "symm_mem one_shot": 0,
                                                       "commopt matmul_ar": 0}}}
    return {**record, **changes}


def test_speedups_the_hbm_floor_and_the_all_reduce_time_come_from_the_times():
    (c,) = decode_step.derive([_record()])
    assert c["tokens_per_s"]["commopt"] == pytest.approx(1000.0)  # 8 tokens in 8 ms
    assert c["speedup_vs_inductor_nccl"]["commopt oneshot"] == pytest.approx(10.0 / 7.5)
    assert c["hbm_floor_ms"] == pytest.approx(4.8e9 / decode_step.HBM_BYTES_PER_S * 1e3) == pytest.approx(1.0)
    assert c["all_reduce_ms"] == pytest.approx({"inductor+nccl": 4.0, "inductor+symm_mem": 3.0, "commopt": 2.0,
                                                "commopt oneshot": 1.5})
    # agreement: within TOLERANCE_FACTOR x the reference's own error vs the truth; the bound is not compared
    assert c["allowed_error_vs_truth"] == pytest.approx(TOLERANCE_FACTOR * 0.01)
    assert c["agree"] == {"inductor+nccl": True, "inductor+symm_mem": True, "commopt": True, "commopt oneshot": False}
    (c,) = decode_step.derive([_record(same_on_every_rank=dict(_record()["same_on_every_rank"], commopt=False))])
    assert not c["agree"]["commopt"]
    (c,) = decode_step.derive([_record(ms={"commopt": 8.0})])  # no baseline, no bound: no ratios, no AR time
    assert c["speedup_vs_inductor_nccl"] == {} and c["all_reduce_ms"] == {}
    meta = {"mode": "gpu", "shape_name": "Llama-3-8B-shaped, 32 layers", "device": "NVIDIA H200", "world": 2,
            "commit": "c", "date": "d", "torch": "t", "shape": {}, "rounds": 15, "steps": 10, "command": "x"}
    text = decode_step.report(decode_step.derive([_record(not_run={"x": "why"}, cudagraph_skips={"commopt": 1})]), meta)
    row = "| commopt oneshot | 7.500 | 1067 | 1.333 | 1.500 | 5.00e-02 | 5.00e-02 | NO | 64 commopt matmul_ar"
    assert f"{row} (matmul_ar oneshot; 0 kept) |" in text
    assert f"| {decode_step.BOUND} | 6.000 | 1333 | 1.667 | - | - | - | bound | none |" in text
    assert "| inductor+nccl | 10.000 | 800 | 1.000 | 4.000 | 0.00e+00 | 1.00e-02 | yes | - |" in text
    assert "HBM floor 1.000 ms (4.800 GB per rank per step)" in text and "- not run: x: why" in text
    assert "- NOT replayed from CUDA graphs: commopt (Inductor skipped 1 graph(s))" in text
    differ = _record(same_on_every_rank=dict(_record()["same_on_every_rank"], commopt=False))
    assert "| commopt | 8.000 | 1000 | 1.250 | 2.000 | 2.00e-02 | 3.00e-02 | NO (ranks differ) |" in decode_step.report(
        decode_step.derive([differ]), meta)


@pytest.mark.parametrize("argv, error", [(["--world", "3"], "does not split heads 32"),
                                         (["--variants", "commopt,nope"], "unknown ['nope']")])
def test_the_command_line_refuses_a_plan_it_cannot_run(argv, error):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cpu", action="store_true")
    decode_step.add_arguments(p)
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        decode_step.plan_from(p.parse_args(["--step", *argv]))
    plan = decode_step.plan_from(p.parse_args(["--step", "--shared", "--batch", "1", "--ctx", "4096"]))
    assert plan.mode == "shared" and plan.cases == (decode_step.Case(batch=1, ctx=4096),)
    assert plan.shape == dataclasses.replace(decode_step.LLAMA3_8B, layers=decode_step.SHARED_LAYERS)
    assert decode_step.report_variant(plan) == f"{decode_step.SHARED_LAYERS}l_b1_c4k_shared1gpu"
    # the watchdog's pair: asked for on the GPUs only, and its report kept apart from the full one's
    plan = decode_step.plan_from(p.parse_args(["--step", "--batch", "1", "--ctx", "4096", "--variants",
                                               "commopt,commopt_watchdog_off"]))
    assert plan.variants == ("commopt", "commopt watchdog off")
    assert decode_step.report_variant(plan) == "32l_b1_c4k_watchdog"
    with pytest.raises(ValueError, match="unknown"):
        decode_step.plan_from(p.parse_args(["--step", "--cpu", "--variants", "commopt,commopt_watchdog_off"]))


def test_a_run_cut_short_keeps_the_cases_it_finished(tmp_path, capsys):
    import json

    plan = dataclasses.replace(_cpu_plan(), partial=str(tmp_path / "partial.jsonl"))
    for batch in (1, 8):
        decode_step._kept(_record(batch=batch), 0, plan)
        decode_step._kept(_record(batch=batch), 1, plan)  # rank 0's alone
    kept = [json.loads(line) for line in (tmp_path / "partial.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in kept] == [1, 8] and "tokens_per_s" not in kept[0]  # the raw record
    assert "batch 8, context 4096:\n| inductor+nccl | 10.000 | 800 |" in capsys.readouterr().out


def test_the_watchdog_off_variant_runs_with_the_switch_off_and_leaves_it_as_it_was(monkeypatch):
    """compiled() wraps the variant's step in its environment (read at the compile, the capture
    and each replay); the caller's value comes back after each call, also after a failure."""
    from benchmarks.common import with_env
    from torch_commopt.core import env

    monkeypatch.setenv(env.WATCHDOG, "1")
    seen = []

    def step(x):
        seen.append(os.environ.get(env.WATCHDOG))
        if x is None:
            raise RuntimeError("boom")
        return x + 1

    run = with_env(step, decode_step.VARIANT_ENV["commopt watchdog off"])
    assert run(1) == 2 and seen == ["0"] and os.environ[env.WATCHDOG] == "1"
    with pytest.raises(RuntimeError):
        run(None)
    assert seen == ["0", "0"] and os.environ[env.WATCHDOG] == "1"
