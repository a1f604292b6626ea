"""bench_torchtitan's rounds (the job order reversed every other round) and its pairing of each
variant with the inductor job of the same round, on synthetic records."""

import pytest

from benchmarks import bench_torchtitan


def test_every_other_round_runs_the_variants_in_reverse():
    assert bench_torchtitan.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    with pytest.raises(ValueError, match="rounds"):
        bench_torchtitan.round_orders(["a"], 0)


def test_each_variant_is_compared_with_the_inductor_job_of_its_round():
    # the GPUs slow down over the run: round 1's jobs are all 10% slower, the ratio stays
    recs = [{"backend": "inductor", "round": 0, "step_ms": 100.0}, {"backend": "commopt", "round": 0, "step_ms": 95.0},
            {"backend": "commopt", "round": 1, "step_ms": 104.5}, {"backend": "inductor", "round": 1, "step_ms": 110.0},
            {"backend": "broken", "round": 0, "step_ms": None}, {"backend": "alone", "round": 2, "step_ms": 90.0}]
    got = bench_torchtitan.paired(recs)
    assert got["commopt"]["speedup_vs_inductor_by_round"] == pytest.approx([100 / 95, 110 / 104.5])
    assert got["commopt"]["speedup_vs_inductor"] == pytest.approx(100 / 95)
    assert got["commopt"]["step_ms_median"] == pytest.approx((95 + 104.5) / 2) and got["commopt"]["rounds"] == 2
    assert "broken" not in got  # a job that logged no steps has nothing to pair
    assert got["alone"]["speedup_vs_inductor"] is None  # no inductor job in its round
    lines = bench_torchtitan.report({"torchtitan": "0.2.2", "device": "2x X", "torch": "t", "commit": "c", "date": "d",
                                     "command": "python3 x"},
                                    [dict(r, parallel="TP=2", seq=8, batch=1, returncode=0, steps_logged=0, tokens_per_s=None,
                                          peak_mem_gib=None, loss_first=None, loss_last=None, losses=[]) for r in recs])
    assert "- commopt: 1.053x inductor's tokens/s (rounds: 1.053, 1.053); median step 99.8 ms" in lines


def test_the_profiled_step_writes_each_rank_s_chrome_trace_where_asked(tmp_path, monkeypatch):
    """benchmarks/tt_profile.py on a stand-in trainer (CPU: the CUDA activity and synchronize are
    stood in for): only the N-th train_step is profiled, its tables printed, and with TT_TRACE_DIR
    its Chrome trace written under the variant's name, Python stacks included."""
    import importlib
    import json
    import sys
    import types

    import torch
    import torch.profiler

    class Trainer:
        def train_step(self, x):
            return torch.relu(x @ x).sum()

    real_profile = torch.profiler.profile
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities, **kw: real_profile(activities=[torch.profiler.ProfilerActivity.CPU], **kw))
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(Trainer=Trainer))
    monkeypatch.setenv("TT_PROFILE_STEP", "2")
    monkeypatch.setenv("TT_TRACE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("TT_VARIANT", "commopt_r0")
    sys.modules.pop("benchmarks.tt_profile", None)
    importlib.import_module("benchmarks.tt_profile")
    trainer, x = Trainer(), torch.randn(8, 8)
    trainer.train_step(x)
    assert not (tmp_path / "traces").exists()  # the first call is not the profiled one
    trainer.train_step(x)
    trace = json.loads((tmp_path / "traces" / "commopt_r0_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::relu" in names and any("train_step" in str(n) for n in names)  # the op and its Python stack
    sys.modules.pop("benchmarks.tt_profile", None)


def test_the_comm_free_bound_strips_the_compiled_graphs_collectives_and_is_reported_as_a_bound(monkeypatch):
    """benchmarks/tt_comm_free.py (the inductor-comm-free variant's custom import) sets comm_free's
    post-grad pass and turns the caches off; the report names the variant a bound and compares no
    losses with it; a profiled step keeps the one custom import."""
    import importlib
    import sys

    import torch
    import torch._functorch.config as functorch_config

    from benchmarks import comm_free

    monkeypatch.delenv("TT_PROFILE_STEP", raising=False)
    sys.modules.pop("benchmarks.tt_comm_free", None)
    # the config modules' own patch restores what the import sets (pytest's monkeypatch would
    # delete a config entry it cannot see as an attribute)
    with torch._inductor.config.patch({"post_grad_custom_post_pass": None, "fx_graph_cache": True}), \
            functorch_config.patch(enable_autograd_cache=True):
        importlib.import_module("benchmarks.tt_comm_free")
        assert torch._inductor.config.post_grad_custom_post_pass is comm_free.PASS
        assert torch._inductor.config.fx_graph_cache is False and functorch_config.enable_autograd_cache is False
    assert torch._inductor.config.post_grad_custom_post_pass is None
    sys.modules.pop("benchmarks.tt_comm_free", None)

    recs = [dict(backend=b, round=0, step_ms=ms, parallel="TP=2", seq=8, batch=1, returncode=0, steps_logged=2,
                 tokens_per_s=1.0, peak_mem_gib=None, loss_first=1.0, loss_last=0.5, losses=[1.0, 0.5])
            for b, ms in (("inductor", 100.0), ("commopt", 96.0), ("inductor-comm-free", 93.0))]
    text = bench_torchtitan.report({"torchtitan": "0.2.2", "device": "2x X", "torch": "t", "commit": "c", "date": "d",
                                    "command": "python3 x"}, recs)
    assert "inductor-comm-free is a bound, not a backend" in text
    assert "- inductor-comm-free: 1.075x inductor's tokens/s" in text
    assert "inductor-comm-free (round 0) vs inductor" not in text  # its losses are meaningless
