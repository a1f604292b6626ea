"""Per-call CUDA graphs (kernels/gpu/call_graphs.py): when a call is captured, replayed or run
eagerly, and what the runtime's call count does meanwhile.  The graphs here are stand-ins (no
CUDA); tests/gpu/test_gpu_schedules.py replays real ones against the reference."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import call_graphs
from torch_commopt.kernels.gpu.call_graphs import CallGraphs


@pytest.fixture(autouse=True)
def _no_host_replay(monkeypatch):
    """Eager calls here run their body (test_host_replay.py covers the replayed ones)."""
    monkeypatch.setenv(env.HOST_REPLAY, "0")


class FakeRuntime:
    """The runtime's host state a call touches: its call count and deferred token takes."""

    def __init__(self):
        self.epoch, self.untaken, self.device, self.group_name = 0, {}, torch.device("cuda", 0), "g"

    def next_epoch(self):
        self.untaken.clear()
        self.epoch += 1
        return self.epoch

    def rewind(self, epoch):
        self.untaken.clear()
        self.epoch = epoch

    def debug_waits(self, sched):
        return bool(sched.param("dbg", 0))

    # the watchdog's brackets (symm.GroupRuntime.begin_call / end_call): counted, nothing queued
    watch, closed = None, None

    def check_open(self):
        if self.closed is not None:
            raise RuntimeError(self.closed)

    def begin_call(self, op, sched):
        self.check_open()
        self.begun = getattr(self, "begun", 0) + 1
        return ("watched", self.begun)

    def end_call(self, watched):
        self.ended = getattr(self, "ended", 0) + 1


class FakeGraph:
    def __init__(self, half):
        self.half, self.replays = half, 0

    def replay(self):
        self.replays += 1


@pytest.fixture
def graphs(monkeypatch):
    """A CallGraphs whose captures record the half the captured call took (body run 'dry')."""
    cg = CallGraphs(torch.device("cuda", 0))
    captured = []

    def capture(rt, body):
        halves = []
        body(halves)
        captured.append(halves[0])
        return FakeGraph(halves[0])

    monkeypatch.setattr(cg, "_capture", capture)
    cg.captured = captured
    return cg


def _body(rt, log):
    """A call: counts itself (as every schedule does first) and records its buffer half."""
    def body(into=None):
        half = rt.next_epoch() % 2
        (log if into is None else into).append(half)
    return body


def test_second_sighting_captures_and_later_calls_replay_in_their_half(graphs):
    rt, eager = FakeRuntime(), []
    for _ in range(8):
        graphs.run(rt, ("matmul_rs", "ce_push:1"), _body(rt, eager), lambda: None)
    # halves alternate 1, 0, 1, 0, ...: each half's call is first run eagerly, captured at its
    # second sighting, then replayed
    assert eager == [1, 0] and graphs.captured == [1, 0]
    assert graphs.stats == {"eager": 2, "captured": 2, "replayed": 4, "dropped": 0}
    assert sorted(e.graph.half for e in graphs.graphs.values()) == [0, 1]
    assert all(e.graph.replays == 3 and e.replays == 2 for e in graphs.graphs.values())  # + the capture's own
    assert rt.epoch == 8  # every call counted once, replayed or not: the ranks agree on the halves


def test_a_different_address_or_layout_is_a_different_call(graphs):
    rt, eager = FakeRuntime(), []
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    keys = [("x", call_graphs.signature(a)), ("x", call_graphs.signature(b)), ("x", call_graphs.signature(a.t())),
            ("x", call_graphs.signature(a[:2])), ("x", call_graphs.signature(a.to(torch.float64)))]
    assert len(set(keys)) == len(keys)
    for key in keys:  # each seen once (per half): nothing captured
        graphs.run(rt, key, _body(rt, eager), lambda: None)
    assert graphs.captured == [] and len(eager) == len(keys)
    assert call_graphs.signature(None) is None


def test_a_refused_capture_runs_eagerly_and_is_tried_again(graphs):
    rt, eager = FakeRuntime(), []
    refusals = iter(["no buffer yet", None])
    for _ in range(7):
        graphs.run(rt, ("k",), _body(rt, eager), lambda: next(refusals, None))
    # half 1's second sighting is refused (eager), half 0's captured; half 1 is then seen once
    # more (eager) and captured at the sighting after
    assert eager == [1, 0, 1, 1] and graphs.captured == [0, 1]
    assert graphs.failed is None and rt.epoch == 7


def test_the_least_recently_replayed_graph_is_dropped(graphs, monkeypatch):
    monkeypatch.setattr(call_graphs, "CAPACITY", 2)
    rt, eager = FakeRuntime(), []
    for key in ["a", "a", "a", "a", "b", "b", "b", "b"]:  # a: halves 1, 0 captured; then b's two
        graphs.run(rt, (key,), _body(rt, eager), lambda: None)
    assert [k[0] for k in graphs.graphs] == ["b", "b"] and graphs.stats["dropped"] == 2


class BrokenGraph:
    """A capture the driver refuses at its end (an operation a capture does not allow)."""

    def capture_begin(self, **kwargs):
        pass

    def capture_end(self):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_rewinds_the_call_count_and_stops_capturing(monkeypatch, caplog):
    cg = CallGraphs(torch.device("cuda", 0))
    monkeypatch.setattr(cg, "_capture_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", BrokenGraph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _NullContext())
    rt, eager = FakeRuntime(), []

    def body():
        half = rt.next_epoch() % 2
        rt.untaken[1] = 512  # a token take the capture deferred to a signal it never reached
        eager.append(half)

    with caplog.at_level(logging.WARNING, logger="torch_commopt.kernels.gpu.call_graphs"):
        for _ in range(6):
            cg.run(rt, ("k",), body, lambda: None)
    # calls 1, 2 eager (first sightings); call 3's capture (its body's dry run, half 1) fails:
    # the count is rewound and the call runs eagerly in the same half; the rest run eagerly
    assert eager == [1, 0, 1, 1, 0, 1, 0] and rt.epoch == 6
    assert cg.failed and "not permitted" in cg.failed and "no more calls are captured" in caplog.text
    assert cg.stats == {"eager": 6, "captured": 0, "replayed": 0, "dropped": 0}


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


def test_calls_without_cg_or_with_bounded_waits_or_uncapturable_run_eagerly(monkeypatch):
    ran = []
    rt = FakeRuntime()
    monkeypatch.setattr(call_graphs, "for_stream", lambda device: pytest.fail("a per-call graph was looked up"))
    for op, sched in [("matmul_rs", "ce_push:1"), ("matmul_rs", "ce_push:1:cg=1,dbg=1"), ("matmul_rs", "fused:2:cg=1")]:
        call_graphs.call(op, Schedule.parse(sched), rt, (None,), (), lambda: ran.append(sched), lambda: None)
    monkeypatch.setenv(call_graphs.ENV, "0")
    call_graphs.call("matmul_rs", Schedule.parse("ce_push:1:cg=1"), rt, (None,), (), lambda: ran.append("env"),
                     lambda: None)
    assert ran == ["ce_push:1", "ce_push:1:cg=1,dbg=1", "fused:2:cg=1", "env"]
    assert call_graphs.replayable("ag_matmul", Schedule.parse("fused:2:cg=1"), rt) == f"{call_graphs.ENV}=0"


def test_cg_calls_are_keyed_by_their_tensors_and_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(call_graphs, "for_stream", lambda device: SimpleNamespace(
        run=lambda rt, key, body, refusal, n_head: seen.append(key)))
    a, w = torch.zeros(8, 4), torch.zeros(4, 4)
    sched = Schedule.parse("ce_push:1:cg=1")
    call_graphs.call("matmul_rs", sched, FakeRuntime(), (a, w, None), (0, "sum"), lambda: None, lambda: None)
    assert seen == [("matmul_rs", "g", "ce_push:1:cg=1", (0, "sum"), call_graphs.signature(a),
                     call_graphs.signature(w), None)]  # "g": the process group


def test_misses_count_which_argument_moved(graphs):
    rt = FakeRuntime()
    a, w, outs = torch.zeros(4), torch.zeros(4), [torch.zeros(4) for _ in range(4)]
    head = ("matmul_rs", "g", "ce_push:1:cg=1", ())
    for out in outs:  # the output moves every call, the input and weight stay: never captured
        for _ in range(2):  # both halves
            sigs = tuple(call_graphs.signature(t) for t in (a, w, out))
            graphs.run(rt, head + sigs, _body(rt, []), lambda: None, len(head))
    assert graphs.captured == [] and graphs.moved == {"matmul_rs arg 2": 6}


def _counted_graphs(monkeypatch, window):
    monkeypatch.setattr(call_graphs, "WINDOW", window)
    cg = CallGraphs(torch.device("cuda", 0))

    def capture(rt, body):
        rt.next_epoch()
        return FakeGraph(rt.epoch % 2)

    monkeypatch.setattr(cg, "_capture", capture)
    return cg


def test_captures_stop_where_the_addresses_do_not_come_back(monkeypatch, caplog):
    cg = _counted_graphs(monkeypatch, window=40)
    rt = FakeRuntime()
    with caplog.at_level(logging.WARNING, logger="torch_commopt.kernels.gpu.call_graphs"):
        for i in range(80):
            # a call at fixed addresses (replayed), then one whose tensors move every other
            # step: seen twice in its half, captured, never replayed
            cg.run(rt, ("steady",), _body(rt, []), lambda: None)
            cg.run(rt, ("moving", i // 2), _body(rt, []), lambda: None)
    assert cg.failed and "never replayed" in cg.failed and "no more are captured" in caplog.text
    captured = cg.stats["captured"]
    for _ in range(4):  # each half seen twice: would be captured
        cg.run(rt, ("moving", "new"), _body(rt, []), lambda: None)
    assert cg.stats["captured"] == captured  # no more captures; the steady call still replays
    replayed = cg.stats["replayed"]
    cg.run(rt, ("steady",), _body(rt, []), lambda: None)
    assert cg.stats["replayed"] == replayed + 1


def test_captures_go_on_in_a_loop_whose_calls_come_back(monkeypatch):
    cg = _counted_graphs(monkeypatch, window=40)
    rt = FakeRuntime()
    for step in range(200):
        for site in range(6):  # six call sites at fixed addresses; a new one joins late
            cg.run(rt, ("site", site), _body(rt, []), lambda: None)
        if step >= 150:
            cg.run(rt, ("late",), _body(rt, []), lambda: None)
    assert cg.failed is None and cg.stats["captured"] == 2 * 6 + 2


def test_cg_is_an_option_of_the_gpu_schedules_and_the_autotune_placeholder():
    assert Schedule.parse("ce_push:1:cg=1").param("cg") == 1
    assert str(Schedule.parse("fused:2:cg=1,tma=1")) == "fused:2:cg=1,tma=1"
    assert Schedule.parse("autotune:1:cg=1,id=x").param("cg") == 1
    for bad in ["sequential:1:cg=1", "chunked:2:cg=1", "ce_push:1:cg=2"]:
        with pytest.raises(ValueError, match="cg=0/1"):
            Schedule.parse(bad)


def _region(kind, a_shape, w_shape, device="cuda"):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a_val = torch.empty(a_shape, device=device, dtype=torch.bfloat16)
        w_val = torch.empty(w_shape, device=device, dtype=torch.bfloat16)
    graph = torch.fx.Graph()
    a, w = graph.placeholder("a"), graph.placeholder("w")
    a.meta["val"], w.meta["val"] = a_val, w_val
    return SimpleNamespace(kind=kind, a=a, t_shape=None, dim=0, group_size=2, dynamic=False, a_view=None,
                           consumers=[SimpleNamespace(weight=w)])


def test_short_eager_regions_replay_per_call_graphs_and_are_ranked_as_replayed():
    from torch_commopt.config import Config
    from torch_commopt.passes import choose

    short = _region("ag_matmul", [1024, 8192], [8192, 4096])  # M_global 2048: est. GEMM 0.2 ms
    long = _region("ag_matmul", [4096, 8192], [8192, 4096])  # est. GEMM 0.8 ms
    tiny = _region("ag_matmul", [256, 8192], [8192, 4096])  # M_global 512: est. GEMM 0.05 ms
    on, off, graphs = Config(call_graphs=True), Config(), Config(cuda_graphs=True, call_graphs=True)
    assert not Config().call_graphs  # opt-in (see Config's docstring)
    assert choose.per_call_graphs(short, on) and choose.replay_mode(short, on)
    assert not choose.per_call_graphs(long, on) and not choose.replay_mode(long, on)
    assert not choose.per_call_graphs(tiny, on) and not choose.replay_mode(tiny, on)  # host-bound even replayed
    assert not choose.per_call_graphs(short, off) and not choose.replay_mode(short, off)
    assert not choose.per_call_graphs(short, graphs) and choose.replay_mode(short, graphs)
    assert not choose.per_call_graphs(_region("ag_matmul", [1024, 8192], [8192, 4096], device="cpu"), on)


def test_the_short_eager_region_gets_the_replayed_pick_with_cg(monkeypatch, tmp_path):
    from torch_commopt import report as explain
    from torch_commopt.config import Config
    from torch_commopt.passes import choose

    report = explain.GraphReport(graph_id=0, graph_kind="forward", compile_id=None)
    region = _region("ag_matmul", [1024, 8192], [8192, 4096])  # in the band: no first-call timing
    region.collective = SimpleNamespace(name="all_gather_0")
    assert str(choose.schedule_for(region, Config(call_graphs=True), report)) == "ce_push:1:cg=1,par=1"
    assert str(choose.schedule_for(region, Config(cuda_graphs=True, call_graphs=True), report)) == "ce_push:1:par=1"
    assert any("all_gather_0: picked ce_push:1:par=1 " in n for n in report.notes)
    # M_global 512: NCCL + cuBLAS eager; a replayed program times one GEMM after the gather, the
    # peer's GEMM beside the own shard's and NCCL as replays at its first call (the rule's
    # gemm=whole where nothing can be timed)
    import torch_commopt.tuner.machine as machine
    from torch_commopt.tuner.matmul import autotune

    monkeypatch.setattr(machine, "device_name", lambda device: "fake GPU")
    tiny = _region("ag_matmul", [256, 8192], [8192, 4096])
    tiny.collective, tiny.group_name = SimpleNamespace(name="all_gather_1"), "g"
    assert str(choose.schedule_for(tiny, Config(call_graphs=True), report)) == "sequential"
    placeholder = choose.schedule_for(tiny, Config(cuda_graphs=True, cache_dir=str(tmp_path)), report)
    req = autotune._REQUESTS[placeholder.param("id")]
    assert placeholder.name == "autotune" and req.graphs and req.fallback == "ce_push:1:gemm=whole"
    assert req.candidates == ["sequential", "ce_push:1:gemm=whole", "ce_push:1:par=1"]


def test_all_regions_replay_per_call_graphs_when_asked():
    """Config.call_graphs="all": the long eager regions too (a host-bound step), never the
    regions under the band's lower end (host-bound even replayed), nor without CUDA."""
    import pytest

    from torch_commopt.config import Config
    from torch_commopt.passes import choose

    every = Config(call_graphs="all")
    short = _region("ag_matmul", [1024, 8192], [8192, 4096])
    long = _region("ag_matmul", [4096, 8192], [8192, 4096])
    tiny = _region("ag_matmul", [256, 8192], [8192, 4096])
    assert choose.per_call_graphs(short, every) and choose.per_call_graphs(long, every)
    assert choose.replay_mode(long, every)
    assert not choose.per_call_graphs(long, Config(call_graphs=True))  # the band alone
    assert not choose.per_call_graphs(tiny, every)
    assert not choose.per_call_graphs(long, Config(call_graphs="all", cuda_graphs=True))  # the program's own graphs
    assert not choose.per_call_graphs(_region("ag_matmul", [4096, 8192], [8192, 4096], device="cpu"), every)
    with pytest.raises(ValueError, match="Config.call_graphs: expected False, True or 'all'"):
        Config(call_graphs="some")


def test_every_run_of_a_call_is_watched_and_a_closed_runtime_refuses_before_anything_runs(monkeypatch):
    """call() brackets body() with the runtime's begin_call / end_call (the watchdog's marks; a
    capture takes them along, so replays are watched too), the call's waits recorded meanwhile
    (rt.watch set); once the watchdog closed the runtime, a call raises before it runs or replays."""
    rt, seen = FakeRuntime(), []
    monkeypatch.setattr(call_graphs, "for_stream", lambda device: SimpleNamespace(
        run=lambda rt_, key, body, refusal, n_head: body()))

    def body():
        seen.append(rt.watch)

    for sched in ("ce_push:1", "ce_push:1:cg=1"):
        call_graphs.call("matmul_rs", Schedule.parse(sched), rt, (None,), (), body, lambda: None)
    assert seen == [("watched", 1), ("watched", 2)] and rt.ended == 2 and rt.watch is None
    with pytest.raises(RuntimeError, match="boom"):  # the end is queued even when the body raises
        call_graphs.call("matmul_rs", Schedule.parse("ce_push:1"), rt, (None,), (),
                         lambda: (_ for _ in ()).throw(RuntimeError("boom")), lambda: None)
    assert rt.ended == 3 and rt.watch is None
    rt.closed = "stuck"
    monkeypatch.setattr(call_graphs, "for_stream", lambda device: pytest.fail("a closed runtime replayed"))
    with pytest.raises(RuntimeError, match="stuck"):
        call_graphs.call("matmul_rs", Schedule.parse("ce_push:1:cg=1"), rt, (None,), (), body, lambda: None)
    assert len(seen) == 2
