"""Eager calls replayed from per-call CUDA graphs (schedule parameter cg=1).

A short GPU schedule called eagerly is host-bound: its ~10-20 driver calls and cuBLAS launches
take 0.13-0.23 ms of host a call at two ranks and 0.4-0.7 ms at four, more than its GPU time,
while a one-call graph's launch takes 6-20 us of host (docs/gpu-schedules.md#per-call-cuda-graphs).

So a call with cg=1 is captured into a CUDA graph the second time the same call is seen, and
replayed from then on.  "The same call": op, schedule, the buffer half it takes, its scalar
arguments and every tensor it reads or writes -- address, shape, strides, dtype.  A graph reads
and writes addresses, so it serves any later call whose tensors sit where its own did, whatever
they hold (a training loop's caching allocator hands the same addresses step after step).  The
outputs are allocated by the caller before the call (outside the graph), so a returned tensor
is never a graph's memory that a later replay overwrites; what the schedule allocates inside
(staging, a contiguous copy of A) comes from one memory pool shared by the graphs of one device
and caller stream, whose replays never overlap (each runs on that stream and joins its side
streams).  Graphs are kept per process group too (the key names it).

Why replays and eager calls may mix, across ranks too: the protocol is closed (symm's module
docstring): a captured call does on the GPU what an eager call of the same schedule and buffer
half does, and every rank takes the same half at the same call (the runtime's epoch counts
calls alike on every rank, replayed or not).  Whether a rank replays is its own business.

Not replayed: calls inside a capture (the program's own graph), calls with bounded (debug)
waits (their status check synchronizes), schedules that cannot be captured (the fused
reductions' barrier counts epochs), and new captures on a device and stream after one failed
there or once captures stop paying for themselves (WINDOW; logged either way: the eager call
runs instead, the graphs already made still replay).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from torch_commopt.core import env
from torch_commopt.kernels.gpu import host_replay

log = logging.getLogger("torch_commopt.kernels.gpu.call_graphs")

ENV = env.CALL_GRAPHS  # "0": never replay (cg=1 calls run eagerly)
# Graphs kept per device and stream (least recently replayed dropped first): a training step's
# region calls, each in its buffer half (Config.call_graphs="all": ~8 a layer with its backward)
CAPACITY = 256
SIGHTINGS = 1024  # calls remembered per device and stream while they wait for their second sighting
# Whether captures pay is judged on the graphs captured at least WINDOW calls ago (the last
# HISTORY captures): when more than half of at least MIN_JUDGED of them were never replayed, the
# program's tensors do not come back to the same addresses and every capture is host time lost
# (a training step whose tensors moved ran slower than without graphs:
# docs/gpu-schedules.md#per-call-cuda-graphs).  Captures stop there, logged; the graphs already
# made still replay.  A graph replayed even once in a loop of thousands of steps pays back its
# capture.
WINDOW = 256
HISTORY = 64
MIN_JUDGED = 8


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # a CPU-only build
        return False


def enabled_by_env() -> bool:
    """TORCH_COMMOPT_CALL_GRAPHS, read now (core/env.py)."""
    return env.call_graphs()


def signature(t: torch.Tensor | None):
    """What a graph depends on of one tensor argument: where it is and how it is laid out."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class _Graph:
    """A captured call: its graph, when it was captured (the CallGraphs' call count) and how
    often it was replayed since."""

    __slots__ = ("graph", "born", "replays")

    def __init__(self, graph, born: int):
        self.graph, self.born, self.replays = graph, born, 0


class CallGraphs:
    """The captured calls made on one device from one caller stream (graphs replayed on one
    stream run one after another, so their temporaries may share one memory pool), that pool,
    and the stream captures run on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, int] = OrderedDict()
        self.history: deque[_Graph] = deque(maxlen=HISTORY)  # the last captures, dropped ones too
        self.calls = 0
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.failed: str | None = None  # why captures stopped (a failure, or captures that did not pay)
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "dropped": 0}
        self.last_ptrs: dict[tuple, tuple] = {}  # site -> its tensors' addresses at its last missed call
        self.moved: dict[str, int] = {}  # "op arg i" -> misses where argument i had moved

    def run(self, rt, key: tuple, body: Callable[[], None], refusal: Callable[[], str | None],
            n_head: int | None = None) -> None:
        """body() for this call (it writes the caller's preallocated outputs and starts with the
        runtime's next_epoch): replayed when `key` (without the half, which is added here) has
        a graph, captured then replayed on its second sighting unless refusal() names a reason
        (no symmetric buffer yet: the call runs eagerly and the next sighting tries again),
        else run eagerly.  n_head: where the tensors' signatures start in `key` (a miss counts
        which of them moved since the same call site's last call in this half, `moved`)."""
        self.calls += 1
        half = (rt.epoch + 1) % 2
        key = key + (half,)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            rt.next_epoch()  # what body() would have counted
            entry.graph.replay()
            entry.replays += 1
            self.stats["replayed"] += 1
            return
        if n_head is not None:
            sigs = key[n_head:-1]
            self._note_moves(key[:n_head] + tuple(s and s[1:] for s in sigs) + (half,), tuple(s and s[0] for s in sigs))
        if self.failed is None and self._second_sighting(key) and refusal() is None:
            graph = self._capture(rt, body)
            if graph is not None:
                self._keep(key, _Graph(graph, self.calls))
                graph.replay()
                self.stats["captured"] += 1
                self._judge()
                return
        body()
        self.stats["eager"] += 1

    def _note_moves(self, site: tuple, ptrs: tuple) -> None:
        """Which tensor arguments of a missed call sit elsewhere than at the site's last call:
        the diagnosis of a program whose calls do not come back (inputs, weights or outputs)."""
        last = self.last_ptrs.pop(site, None)
        if last is not None:
            for i, (now, before) in enumerate(zip(ptrs, last)):
                if now != before:
                    self.moved[f"{site[0]} arg {i}"] = self.moved.get(f"{site[0]} arg {i}", 0) + 1
        self.last_ptrs[site] = ptrs
        while len(self.last_ptrs) > SIGHTINGS:
            self.last_ptrs.pop(next(iter(self.last_ptrs)))

    def _judge(self) -> None:
        """Stop capturing where captures are not replayed (see WINDOW)."""
        judged = [g for g in self.history if g.born <= self.calls - WINDOW]
        wasted = sum(1 for g in judged if g.replays == 0)
        if len(judged) >= MIN_JUDGED and 2 * wasted > len(judged):
            self.failed = (f"{wasted} of the {len(judged)} calls captured {WINDOW}+ calls ago were never replayed "
                           "(their tensors do not come back to the same addresses)")
            log.warning("commopt: per-call graphs: %s; no more are captured on %s (the %d kept still replay)",
                        self.failed, self.device, len(self.graphs))

    def _second_sighting(self, key: tuple) -> bool:
        count = self.seen.pop(key, 0) + 1
        if count >= 2:
            return True
        self.seen[key] = count
        while len(self.seen) > SIGHTINGS:
            self.seen.popitem(last=False)
        return False

    def _keep(self, key: tuple, entry: _Graph) -> None:
        self.graphs[key] = entry
        self.history.append(entry)
        while len(self.graphs) > CAPACITY:  # the new graph stays: the pool never loses its last user
            self.graphs.popitem(last=False)
            self.stats["dropped"] += 1

    def _capture(self, rt, body) -> torch.cuda.CUDAGraph | None:
        """A graph of body(), or None (and no more captures on this device and stream) if
        capturing failed, the runtime's call count rewound (the eager call runs next)."""
        epoch = rt.epoch
        try:
            stream = self._capture_stream()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - the eager call runs instead, logged
            rt.rewind(epoch)
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("commopt: capturing an eager call into a CUDA graph failed (%s); no more calls are captured "
                        "on %s from this stream (the graphs kept still replay)", self.failed, self.device)
            return None
        return graph

    def _capture_stream(self) -> torch.cuda.Stream:
        """The stream captures run on (not the caller's, which may be the legacy default stream,
        where capturing is not allowed); a replay runs on the caller's."""
        if self.stream is None:
            stream = torch.cuda.Stream(device=self.device)
            # cuBLAS keeps a workspace per stream, allocated at the stream's first GEMM: let that
            # happen here, outside any capture, not inside the graphs' pool.
            with torch.cuda.stream(stream):
                x = torch.ones((8, 8), device=self.device)
                torch.mm(x, x)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.stream = stream
        return self.stream

    def clear(self) -> None:
        """Drop every graph (and the pool with the last of them)."""
        self.graphs.clear()
        self.seen.clear()
        self.last_ptrs.clear()
        self.pool = None


_BY_STREAM: dict[tuple[int, int], CallGraphs] = {}


def for_stream(device: torch.device) -> CallGraphs:
    """The CallGraphs of `device` and its current stream (the stream the call runs on)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    cg = _BY_STREAM.get(key)
    if cg is None:
        cg = _BY_STREAM[key] = CallGraphs(torch.device("cuda", index))
    return cg


def call(op: str, sched, rt, tensors: tuple, scalars: tuple, body: Callable[[], None],
         refusal: Callable[[], str | None]) -> None:
    """Run one GPU-schedule call, body(), eagerly or from its graph (see the module docstring).
    tensors: every tensor the call reads or writes (None for an absent one), the preallocated
    outputs among them; scalars: its other arguments that body() depends on.  Every run of body()
    is watched (the runtime's begin_call / end_call, kernels/gpu/watchdog.py): a capture takes the
    watchdog's marks with it, so replays are watched too."""
    rt.check_open()
    per_call, in_capture = sched.param("cg"), capturing()
    if not per_call and not in_capture and host_replay.eligible(sched):
        host_replay.call(op, sched, rt, tensors, scalars, body)
        return
    body = functools.partial(_watched, op, sched, rt, body)
    if not per_call or in_capture:  # inside the program's own capture: part of its graph
        body()
        return
    why = replayable(op, sched, rt)
    if why is not None:
        if (op, why) not in _told:
            _told.add((op, why))
            log.info("commopt %s: %s runs eagerly, not from a per-call graph (%s)", op, sched, why)
        body()
        return
    head = (op, rt.group_name, str(sched), scalars)
    for_stream(rt.device).run(rt, head + tuple(signature(t) for t in tensors), body, refusal, len(head))


_told: set[tuple[str, str]] = set()


def _watched(op: str, sched, rt, body: Callable[[], None]) -> None:
    """body() between the runtime's begin_call and end_call, its waits recorded for the watchdog."""
    watched = rt.begin_call(op, sched)
    rt.watch = watched
    try:
        body()
    finally:
        rt.watch = None
        rt.end_call(watched)


def per_call(op: str, sched):
    """`sched` with cg=1 where its calls can be replayed per call (a GPU schedule that a capture
    takes as it is), else `sched` itself."""
    return sched.with_params(cg=1) if sched.is_gpu and sched.in_capture(op) == sched else sched


def replayable(op: str, sched, rt) -> str | None:
    """Why a cg=1 call of `sched` runs eagerly (None: it may be replayed)."""
    if not enabled_by_env():
        return f"{ENV}=0"
    if sched.in_capture(op) != sched:
        return f"{sched} cannot be captured"
    if rt.debug_waits(sched):
        return "bounded (debug) waits"
    return None


def stats() -> dict[str, dict[str, int]]:
    """Per device and caller stream ("device:stream"): calls run eagerly, captured, replayed,
    graphs dropped."""
    return {f"{index}:{stream:#x}": dict(cg.stats) for (index, stream), cg in _BY_STREAM.items()}


def moves() -> dict[str, dict[str, int]]:
    """Per device and caller stream: for each op's tensor argument (by position: ag_matmul a,
    weights, biases, outputs, gathered; the reductions a, weight, bias, output), how many missed
    calls found it at another address than the same call site's last one."""
    return {f"{index}:{stream:#x}": dict(cg.moved) for (index, stream), cg in _BY_STREAM.items()}


def reset() -> None:
    for cg in _BY_STREAM.values():
        cg.clear()
    _BY_STREAM.clear()
