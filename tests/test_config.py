from __future__ import annotations

import math

import pytest
import torch

from torch_commopt import Config, Schedule
from torch_commopt.backend import RefusedOptions, commopt_backend, replayed_by_mode
from torch_commopt.core.attention_spec import CPSchedule


def test_config_round_trips_through_json():
    cfg = Config(schedule="sequential", chunks=2, patterns=("matmul_rs",), debug=True)
    assert Config.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("options,field", [
    ({"bogus": 1}, "bogus"),
    ({"schedule": "fast"}, "Config.schedule"),
    ({"schedule": "sequential:3"}, "Config.schedule"),
    ({"schedule": "autotune:1:id=ab"}, "Config.schedule"),
    ({"schedule": 4}, "Config.schedule"),
    ({"chunks": 0}, "Config.chunks"),
    ({"chunks": True}, "Config.chunks"),
    ({"chunks": 2.0}, "Config.chunks"),
    ({"patterns": ("ag_matmul", "nope")}, "Config.patterns"),
    ({"mode": ["auto"]}, "Config.mode"),
    ({"consistency_timeout_s": -1}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": 0}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": math.nan}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": math.inf}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": True}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": "30"}, "Config.consistency_timeout_s"),
    ({"consistency_timeout_s": 10 ** 400}, "Config.consistency_timeout_s"),
    ({"mode": "model", "memory_budget_mib": math.nan}, "Config.memory_budget_mib"),
    ({"mode": "model", "memory_budget_mib": math.inf}, "Config.memory_budget_mib"),
    ({"mode": "model", "memory_budget_mib": -1.0}, "Config.memory_budget_mib"),
    ({"saved_gather_budget_mib": math.nan}, "Config.saved_gather_budget_mib"),
    ({"saved_gather_budget_mib": -math.inf}, "Config.saved_gather_budget_mib"),
    ({"saved_gather_budget_mib": -0.5}, "Config.saved_gather_budget_mib"),
    ({"attention_schedule": 3}, "Config.attention_schedule"),
    ({"attention_schedule": " ring"}, "Config.attention_schedule"),
    ({"attention_schedule": "ulysses:g=2:early"}, "Config.attention_schedule"),
    ({"moe_schedule": "ring"}, "Config.moe_schedule"),
    ({"moe_schedule": None}, "Config.moe_schedule"),
    ({"ar_split": 0}, "Config.ar_split"),
    ({"extra_inductor_options": {"no_such_inductor_option": 1}}, "Config.extra_inductor_options"),
    ({"fx_graph_cache": "yes"}, "Config.fx_graph_cache"),
    ({"k_parts": "yes"}, "Config.k_parts"),
    ({"mesh2d_axis_schedule": "ce_push:1:par=1"}, "Config.mesh2d_axis_schedule"),
    ({"mesh2d_axis_schedule": "nope:2"}, "Config.mesh2d_axis_schedule"),
    ({"mesh2d_axis_schedule": 1}, "Config.mesh2d_axis_schedule"),
    ({"k_parts": 1}, "Config.k_parts"),
])
def test_bad_options_raise_value_error_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        Config.from_options(options)


def test_good_numbers_and_inductor_keys_pass():
    cfg = Config(mode="model", memory_budget_mib=0, consistency_timeout_s=1,
                 extra_inductor_options={"triton.cudagraphs": False, "fx_graph_cache": True})
    assert cfg.memory_budget_mib == 0 and cfg.consistency_timeout_s == 1
    assert Config(saved_gather_budget_mib=512.5).saved_gather_budget_mib == 512.5


def test_a_mode_that_replays_cuda_graphs_ranks_schedules_as_replayed():
    # torch.compile(mode="reduce-overhead") makes Inductor capture CUDA graphs: decode runs so
    assert replayed_by_mode(Config(), "reduce-overhead").cuda_graphs
    assert replayed_by_mode(Config(), "max-autotune").cuda_graphs
    assert not replayed_by_mode(Config(), "default").cuda_graphs and not replayed_by_mode(Config(), None).cuda_graphs
    kept = Config(cuda_graphs=True)
    assert replayed_by_mode(kept, None) is kept


def test_a_dead_peer_is_waited_for_30_s_by_default():
    assert Config().consistency_timeout_s == 30.0


def test_options_that_are_not_a_mapping_raise():
    with pytest.raises(ValueError, match="dict of Config fields"):
        Config.from_options([("chunks", 2)])


def test_backend_checks_its_arguments_before_compiling(monkeypatch):
    """A bad option gives a graph whose every call raises ValueError naming it; nothing is
    compiled."""
    import torch._inductor.compile_fx as compile_fx

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled despite a bad option")

    monkeypatch.setattr(compile_fx, "compile_fx", no_compile)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for kwargs, name in [({"options": {"bogus": 1}}, "bogus"), ({"options": {"chunks": 0}}, "Config.chunks"),
                         ({"mode": "fastest"}, "mode='fastest'"), ({"nope": 1}, "nope")]:
        refused = commopt_backend(gm, [torch.randn(1, 2)], **kwargs)
        assert isinstance(refused, RefusedOptions)
        for _ in range(2):
            with pytest.raises(ValueError, match=name):
                refused(torch.randn(1, 2))


def _graph_break_fn(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y + 1


@pytest.mark.parametrize("suppress_errors", [False, True])
@pytest.mark.parametrize("fn", [lambda x: x.sin() + 1, _graph_break_fn], ids=["one_graph", "graph_break"])
@pytest.mark.parametrize("options", [{"chunks": -3}, {"consistency_timeout_s": math.nan},
                                     {"schedule": "sequential:3"}, {"bogus": 1}])
def test_torch_compile_raises_the_option_error_whatever_suppress_errors(suppress_errors, fn, options):
    """torch.compile(options=...) reaches the backend only when dynamo compiles, where
    suppress_errors would turn a raise into an eager run without commopt: every call raises the
    ValueError naming the option instead."""
    name = next(iter(options))
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(suppress_errors=suppress_errors):
            compiled = torch.compile(fn, backend="commopt", options=options)
            for _ in range(2):
                with pytest.raises(ValueError, match=name):
                    compiled(torch.randn(2))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("text", ["sequential", "chunked:4", "chunked:1"])
def test_schedule_string_round_trip(text):
    assert str(Schedule.parse(text)) == text


def test_schedule_rejects_unknown_names():
    with pytest.raises(ValueError, match="schedule"):
        Schedule.parse("ring:2")


@pytest.mark.parametrize("text", ["ce_push:2", "ce_pull:3", "direct:1", "fused:4:bm=128,bn=256,store=direct",
                                  "fused:1:dbg=1,store=ce"])
def test_gpu_schedule_strings_round_trip(text):
    sched = Schedule.parse(text)
    assert Schedule.parse(str(sched)) == sched and sched.is_gpu


@pytest.mark.parametrize("text", [
    "sequential", "sequential:1:dbg=1", "chunked:1", "chunked:4", "local_first:1", "auto:1", "auto:2:graphs=1",
    "auto:4:dbg=1,graphs=1", "autotune:1:id=0123abcd", "autotune:1:cg=1,id=x", "ce_push:1:par=1", "ce_push:2:gemm=whole",
    "ce_push:1:cg=1,dbg=1", "fused:2:bk=64,bm=64,bn=128,stages=3,warps=4", "fused:1:store=ce,tma=1",
    "fused:2:store=direct,tma=1", "fused:1:bm=64,bn=128,store=ce,warps=4", "direct:3", "gather_sum",
    "scatter_gather", "gather_sum:1:dbg=1", "oneshot", "oneshot:1:cg=1,dbg=1", "twoshot"])
def test_every_schedule_form_in_use_parses_and_round_trips(text):
    sched = Schedule.parse(text)
    assert str(sched) == text and Schedule.parse(str(sched)) == sched


@pytest.mark.parametrize("text", ["local_first", "auto", "ce_push", "sequential:1"])
def test_a_bare_name_and_sequential_1_parse(text):
    assert Schedule.parse(text).chunks == 1


@pytest.mark.parametrize("text,why", [
    ("fused:2:bm=abc", "integer"), ("fused:2:nope=1", "key=value"), ("ce_push:x", "digits"),
    ("sequential:3", "no piece count"), ("sequential:0", ">= 1"), ("warp:2", "unknown name"),
    ("gather_sum:2", "no piece count"), ("scatter_gather:4", "no piece count"), ("oneshot:2", "no piece count"),
    ("chunked:0", ">= 1"), ("chunked:-1", "digits"), ("chunked:+4", "digits"), ("chunked:2.5", "digits"),
    ("chunked:", "digits"), ("chunked:4:", "key=value"), ("chunked:4 ", "digits"), (" chunked:4", "unknown name"),
    ("fused:2:bm=64,bm=128", "twice"), ("fused:2:bm=64,", "key=value"), ("fused:2:bm", "key=value"),
    ("fused:2:bm= 64", "integer"), ("chunked:4:dbg=1:x", "name:chunks:params"), ("fused:2:store=nvlink", "store"),
    ("autotune:1:id=", "token"), ("autotune:1:id=a b", "token"), ("", "unknown name"),
])
def test_malformed_schedule_strings_raise(text, why):
    with pytest.raises(ValueError, match="schedule") as err:
        Schedule.parse(text)
    assert why in str(err.value), str(err.value)


@pytest.mark.parametrize("value", [None, 3, ("chunked", 2)])
def test_a_schedule_that_is_not_a_string_raises_value_error(value):
    with pytest.raises(ValueError, match="expected a string"):
        Schedule.parse(value)


def test_the_rank_order_sums_are_all_reduce_references_of_their_own():
    for name in ("gather_sum", "scatter_gather"):
        sched = Schedule.parse(name)
        assert sched.reference_twin() == sched and not sched.is_gpu
        assert sched.valid_for("matmul_ar") and not sched.valid_for("matmul_rs") and not sched.valid_for("ag_matmul")
    oneshot = Schedule.parse("oneshot")
    assert oneshot.is_gpu and oneshot.reference_twin() == Schedule("gather_sum") and oneshot.in_capture("matmul_ar") == oneshot
    assert Schedule.parse("twoshot").reference_twin() == Schedule("scatter_gather")


def test_what_runs_inside_a_cuda_graph_capture():
    """The fused reductions run ce_push with the same pieces (and debug setting) inside a capture;
    the rest run as they are."""
    assert Schedule.parse("fused:2:dbg=1,store=direct").in_capture("matmul_rs") == Schedule.parse("ce_push:2:dbg=1")
    for op, text in (("matmul_rs", "ce_pull:3"), ("matmul_ar", "ce_pull:2"), ("ag_matmul", "fused:2:tma=1"),
                     ("matmul_rs", "direct:2"), ("matmul_rs", "ce_push:2")):
        assert Schedule.parse(text).in_capture(op) == Schedule.parse(text)


def test_schedules_built_in_code_are_checked_too():
    with pytest.raises(ValueError, match="no piece count"):
        Schedule("sequential", 2)
    with pytest.raises(ValueError, match="twice"):
        Schedule("fused", 2, (("bm", 64), ("bm", 128)))
    with pytest.raises(ValueError, match="bm"):
        Schedule("fused", 2, (("bm", True),))
    with pytest.raises(ValueError, match="chunks"):
        Schedule("chunked", 2.0)


@pytest.mark.parametrize("text", ["allgather", "ring", "ring_zigzag", "ulysses", "ulysses:early", "ulysses:early:g=2",
                                  "hybrid:2:4", "hybrid:2:4:g=2", "ring_zigzag:g=1"])
def test_attention_schedule_forms_round_trip(text):
    assert str(CPSchedule.parse(text)) == text and Config(attention_schedule=text).attention_schedule == text


@pytest.mark.parametrize("text", [" ring", "ring ", "ring:", "ulysses:g=2:early", "ulysses:early:early",
                                  "ulysses:g=2:g=3", "ulysses:g=", "ulysses:g=+2", "ulysses:g=\u00b2", "hybrid:2:2:early",
                                  "hybrid:2:2:2", "hybrid::2", "hybrid:+2:2", "ring:early", "ulysses:G=2", None, 3])
def test_malformed_attention_schedules_raise(text):
    with pytest.raises(ValueError, match="cp schedule"):
        CPSchedule.parse(text)


@pytest.mark.parametrize("text,twin", [("ce_push:3", "chunked:3"), ("ce_pull:2", "chunked:2"), ("direct:1", "sequential"),
                                       ("fused:4:bm=64", "chunked:4"), ("sequential", "sequential")])
def test_every_gpu_schedule_has_a_reference_twin(text, twin):
    assert str(Schedule.parse(text).reference_twin()) == twin


def test_config_schedule_auto_and_fixed():
    assert Config().schedule == "auto" and Config().fixed_schedule is None
    assert str(Config(schedule="ce_push", chunks=3).fixed_schedule) == "ce_push:3"
    assert str(Config(schedule="fused:2:bm=64").fixed_schedule) == "fused:2:bm=64"
    assert str(Config(schedule="sequential", chunks=5).fixed_schedule) == "sequential"
    # the single-piece schedules stay one piece whatever chunks says (a bare "oneshot" used to take
    # chunks = 4, which it refuses: the pass then left the graph untouched)
    for name in ("oneshot", "twoshot", "gather_sum", "scatter_gather"):
        assert str(Config(schedule=name, chunks=4).fixed_schedule) == name
    with pytest.raises(ValueError, match="debug_waits"):
        Config(debug_waits="yes")
    with pytest.raises(ValueError, match="cuda_graphs"):
        Config(cuda_graphs=1)
    assert Config.from_options({"cuda_graphs": True}).cuda_graphs


def test_cuda_graphs_turns_on_inductor_cudagraph_trees():
    from torch_commopt.backend import inductor_patches

    assert inductor_patches(Config(cuda_graphs=True))["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in inductor_patches(Config())
    off = Config(cuda_graphs=True, extra_inductor_options={"triton.cudagraphs": False})
    assert inductor_patches(off)["triton.cudagraphs"] is False
