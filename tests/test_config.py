from __future__ import annotations

import pytest
import torch

from torch_commopt import Config, Schedule
from torch_commopt.backend import commopt_backend


def test_config_round_trips_through_json():
    cfg = Config(schedule="sequential", chunks=2, patterns=("matmul_rs",), debug=True)
    assert Config.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("options,field", [
    ({"bogus": 1}, "bogus"),
    ({"schedule": "fast"}, "schedule"),
    ({"chunks": 0}, "chunks"),
    ({"chunks": True}, "chunks"),
    ({"patterns": ("ag_matmul", "nope")}, "patterns"),
    ({"consistency_timeout_s": -1}, "consistency_timeout_s"),
    ({"fx_graph_cache": "yes"}, "fx_graph_cache"),
])
def test_bad_options_raise_value_error_naming_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        Config.from_options(options)


def test_backend_rejects_bad_options_before_compiling():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="bogus"):
        commopt_backend(gm, [torch.randn(1, 2)], options={"bogus": 1})


def test_torch_compile_surfaces_the_option_error():
    fn = torch.compile(lambda x: x + 1, backend="commopt", options={"chunks": -3})
    with pytest.raises(Exception, match="chunks"):
        fn(torch.randn(2))


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


@pytest.mark.parametrize("text", ["fused:2:bm=abc", "fused:2:nope=1", "ce_push:x"])
def test_bad_schedule_parameters_raise(text):
    with pytest.raises(ValueError, match="schedule"):
        Schedule.parse(text)


@pytest.mark.parametrize("text,twin", [("ce_push:3", "chunked:3"), ("ce_pull:2", "chunked:2"), ("direct:1", "sequential"),
                                       ("fused:4:bm=64", "chunked:4"), ("sequential", "sequential")])
def test_every_gpu_schedule_has_a_reference_twin(text, twin):
    assert str(Schedule.parse(text).reference_twin()) == twin


def test_config_schedule_auto_and_fixed():
    assert Config().schedule == "auto" and Config().fixed_schedule is None
    assert str(Config(schedule="ce_push", chunks=3).fixed_schedule) == "ce_push:3"
    assert str(Config(schedule="fused:2:bm=64").fixed_schedule) == "fused:2:bm=64"
    assert str(Config(schedule="sequential", chunks=5).fixed_schedule) == "sequential"
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
