"""The GPU schedules' host code on the CPU with CUDA faked out, for tests and probes.

`fake_runtimes(world)` gives one symm.GroupRuntime per rank whose buffers and flags are CPU
tensors (a peer's buffer is that rank's own tensor, so views and addresses of every rank are
distinct); `faked_cuda(runtimes, queue)` patches symm.runtime, the driver's entry points and
torch.cuda's streams so that `ag_matmul_gpu`, `matmul_rs_gpu`, `matmul_ar_gpu` and the
attention's copy-engine all-to-alls (ce_a2a.pipelined) run their real host code: the GEMMs run at
once on the CPU and everything the schedules queue through the
driver or torch's stream events -- flag waits and writes (batched or not), copies (ce_a2a's SM
copies too), event
records and waits -- is appended to `queue` as (rank, stream handle, op), or dropped when `queue` is None (the host
timing probe).  So are the compute kernels' writes into a symmetric buffer (any rank's, shared or
owned), as "store"s: a torch call whose out= or in-place target (mm/bmm/addmm(out=), addmm_,
copy_, add_, sum(out=), __setitem__, ...) lies in one, on the stream it was issued on (the rank's
compute stream, or the one of the innermost torch.cuda.stream block) -- a kernel of the rank's
stream writes those bytes when the stream reaches it, which the simulator must see as much as a
copy's (a GEMM staging into a half a peer still pulls from: commit 9f13be4).  protocol_sim.py
executes such a queue.

    op: ("wait", address, value) | ("write", address, value) | ("copy", dst address, bytes, the
        [start, end) byte intervals it writes, those it reads)
        | ("store", dst address, bytes, the intervals it writes, ()) (its reads are not recorded)
        | ("record", event, instance) | ("wait_event", event, instance)

An event's `instance` numbers its records: a wait binds to the record queued before it."""

from __future__ import annotations

import contextlib
import itertools
import os
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from torch_commopt.core import env
from torch_commopt.kernels.attention import ce_a2a
from torch_commopt.kernels.gpu import driver, symm
from torch_commopt.kernels.moe import ce_exchange
from torch_commopt.kernels.moe.runs import copy_runs2, other

FLAG_BASE = 1 << 40  # rank r's flags live at FLAG_BASE * (r + 1) in the fake address space
BUFFER_BYTES = 1 << 20


class FakeEvent:
    """torch.cuda.Event's stand-in: a handle of its own (apart from the runtimes' driver events)."""

    _handles = itertools.count(1 << 20)

    def __init__(self, *args, **kwargs):
        self.handle = next(self._handles)


class FakeStream:
    """A stream: a handle, and torch's record_event / wait_event (the attention transports use
    them), recorded like the driver's (faked_cuda binds them to the queue)."""

    _handles = itertools.count(100)
    driver_calls: dict = {}  # faked_cuda's entry points while it is active

    def __init__(self, *args, **kwargs):
        self.cuda_stream = next(self._handles)

    def record_event(self, event=None):
        event = event or FakeEvent()
        self.driver_calls["cuEventRecord"](event.handle, self.cuda_stream)
        return event

    def wait_event(self, event) -> None:
        self.driver_calls["cuStreamWaitEvent"](self.cuda_stream, event.handle, 0)

    def wait_stream(self, other) -> None:
        self.wait_event(other.record_event())


class _Handle:
    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers
        self.buffer_ptrs = [b.data_ptr() for b in buffers]

    def get_buffer(self, rank, shape, dtype, offset):
        numel = 1
        for s in shape:
            numel *= s
        return self.buffers[rank].view(dtype)[offset: offset + numel].view(shape)


def fake_runtimes(world: int = 2, owned: tuple[str, ...] = ()) -> list[symm.GroupRuntime]:
    """One runtime per rank over shared CPU buffers and per-rank flag address ranges; `owned`:
    purposes that get an own_buffer of their own (e.g. the attention all-to-all's)."""
    buffers = [torch.zeros(BUFFER_BYTES, dtype=torch.uint8) for _ in range(world)]
    own = {purpose: [torch.zeros(BUFFER_BYTES, dtype=torch.uint8) for _ in range(world)] for purpose in owned}
    events = itertools.count(1)
    runtimes = []
    for rank in range(world):
        rt = symm.GroupRuntime.__new__(symm.GroupRuntime)
        rt.group_name, rt.device = "fake", torch.device("cpu")
        rt.rank, rt.world = rank, world
        rt.peers = [(rank + s) % world for s in range(1, world)]
        rt.sources = [(rank - s) % world for s in range(1, world)]
        rt.epoch = 0
        rt.side, rt.local, rt.compute2, rt.compute = FakeStream(), FakeStream(), FakeStream(), FakeStream()
        rt.flags = torch.zeros(symm.FLAG_SLOTS, dtype=torch.int32)
        rt.flag_bases = [FLAG_BASE * (r + 1) for r in range(world)]
        rt.flag_bases_dev = None
        rt.status = rt.flags[symm.STATUS: symm.STATUS + 8]
        rt.buffers = [symm.SymmBuffer(buffers[rank], _Handle(buffers), rank, None)]
        rt.owned = {purpose: [symm.SymmBuffer(bufs[rank], _Handle(bufs), rank, None)] for purpose, bufs in own.items()}
        rt._debug_kernel_loaded = False
        rt._warned_capture_debug = False
        rt._order_event, rt._event_pools, rt._untaken, rt._begin_batches, rt._eager = None, {}, {}, {}, {}
        rt._new_event = lambda events=events: next(events)
        runtimes.append(rt)
    return runtimes


def _rows(base: int, pitch: int, desc) -> tuple:
    """The byte intervals [start, end) of a 2-D copy's rows at `base` with `pitch`."""
    return tuple((base + r * pitch, base + r * pitch + desc.WidthInBytes) for r in range(desc.Height))


def _handle(stream) -> int:
    """A stream's handle as the driver takes it (a fake or a raw handle)."""
    return stream if isinstance(stream, int) else stream.cuda_stream


def _tensor_rows(t: torch.Tensor) -> tuple:
    """The byte intervals of a tensor whose last dim is contiguous: one per row."""
    elt, width = t.element_size(), t.shape[-1] * t.element_size()
    starts = [t.data_ptr()]
    for size, stride in zip(t.shape[:-1], t.stride()[:-1]):
        starts = [s + j * stride * elt for s in starts for j in range(size)]
    return tuple((s, s + width) for s in starts)


def _spans(t: torch.Tensor) -> tuple:
    """The byte intervals a tensor covers: one for a contiguous one, one per row where the last
    dim is contiguous, else (conservatively) one from its first byte to its last."""
    start, elt = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return ((start, start + t.numel() * elt),)
    if t.stride(-1) == 1:
        return _tensor_rows(t)
    return ((start, start + elt * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))),)


# in-place ops that change a tensor's metadata, not its bytes; and the in-place dunders
_METADATA = frozenset({"requires_grad_", "detach_", "resize_", "resize_as_", "set_", "as_strided_", "squeeze_",
                       "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "share_memory_", "rename_"})
_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                      "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def _written(func, args, kwargs) -> list:
    """The tensors a torch call writes: its out= (one or several), or the first argument of an
    in-place op (add_, copy_, addmm_, baddbmm_, __setitem__, ...)."""
    out = kwargs.get("out") if kwargs else None
    if out is not None:
        return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    name = getattr(func, "__name__", "")
    inplace = name in _DUNDERS or (name.endswith("_") and not name.startswith("_") and name not in _METADATA)
    return [args[0]] if inplace and args and isinstance(args[0], torch.Tensor) else []


class _StoreRecorder(TorchFunctionMode):
    """Records each torch call that writes into a symmetric buffer as a "store" on the stream it
    is issued on (module docstring).  Intercepted rather than inferred from the buffers'
    contents: what matters is where the write sits among the stream's flag operations."""

    def __init__(self, queue: list, state: dict, runtimes):
        super().__init__()
        self.queue, self.state, self.runtimes = queue, state, runtimes
        self.bounds = [(b.local.data_ptr(), b.local.data_ptr() + b.nbytes) for rt in runtimes
                       for b in [*rt.buffers, *(buf for bufs in getattr(rt, "owned", {}).values() for buf in bufs)]]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.state["quiet"]:
            for t in _written(func, args, kwargs):
                self._store(t)
        return func(*args, **(kwargs or {}))

    def _store(self, t: torch.Tensor) -> None:
        ptr = t.data_ptr()
        if t.numel() == 0 or not any(lo <= ptr < hi for lo, hi in self.bounds):
            return
        streams, rank = self.state["streams"], self.state["rank"]
        stream = streams[-1] if streams else self.runtimes[rank].compute.cuda_stream
        written = _spans(t)
        self.queue.append((rank, stream, ("store", ptr, written[0][1] - written[0][0], written, ())))


@contextlib.contextmanager
def _quiet(state: dict):
    """The fakes' own tensor copies (already recorded as copies): no stores."""
    state["quiet"] += 1
    try:
        yield
    finally:
        state["quiet"] -= 1


def _stream_context(state: dict):
    """torch.cuda.stream's stand-in: the stream a store within it is queued on (a fake, a raw
    handle; anything else, or None, leaves the current one)."""
    @contextlib.contextmanager
    def stream(s=None):
        handle = s if isinstance(s, int) else getattr(s, "cuda_stream", None)
        if handle is None:
            yield
            return
        state["streams"].append(handle)
        try:
            yield
        finally:
            state["streams"].pop()
    return stream


def _sm_copy_recorder(queue, active: dict):
    """ce_a2a._sm_copy, recorded as a copy of the rows it writes and reads (and done)."""
    def sm_copy(stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        if queue is not None:
            written = _tensor_rows(dst)
            queue.append((active["rank"], _handle(stream),
                          ("copy", dst.data_ptr(), written[0][1] - written[0][0], written, _tensor_rows(src))))
        with _quiet(active):
            dst.copy_(src)
    return sm_copy


def _run_read2_recorder(queue, active: dict):
    """ce_exchange.read_rows2, recorded as a copy that reads exactly its runs' rows -- of this
    rank's own piece, or of the slots (negative source rows: runs.other) -- and writes the
    destination's (the whole of it, conservatively)."""
    def read_rows2(stream, dst: torch.Tensor, runs, own: torch.Tensor, slots: torch.Tensor) -> None:
        if queue is not None:
            written, read = _tensor_rows(dst), []
            for s, _, n in runs.runs:
                src, at = (own, s) if s >= 0 else (slots, other(s))
                read += _tensor_rows(src[at: at + n])
            queue.append((active["rank"], _handle(stream),
                          ("copy", dst.data_ptr(), written[0][1] - written[0][0], written, tuple(read))))
        with _quiet(active):
            copy_runs2(dst, own, slots, runs)
    return read_rows2


def _entry_points(queue, active: dict):
    """The driver's entry points, recording into `queue` for the active rank (None: no-ops)."""
    instances: dict = {}

    def put(stream, op):
        if queue is not None:
            queue.append((active["rank"], stream, op))
        return 0

    def record(event, stream):
        key = (active["rank"], event)
        instances[key] = instances.get(key, 0) + 1
        return put(stream, ("record", event, instances[key]))

    def batch(stream, count, params, flags):
        for op in params[:count]:
            kind = "wait" if op.operation == driver._OP_WAIT32 else "write"
            put(stream, (kind, op.address, op.value))
        return 0

    return {
        "cuStreamWaitValue32": lambda s, a, v, f: put(s, ("wait", a, v)),
        "cuStreamWriteValue32": lambda s, a, v, f: put(s, ("write", a, v)),
        "cuStreamBatchMemOp": batch,
        "cuMemcpyDtoDAsync": lambda dst, src, n, s: put(s, ("copy", dst, n, ((dst, dst + n),), ((src, src + n),))),
        "cuMemcpy2DAsync": lambda desc, s: put(s, ("copy", desc._obj.dstDevice, desc._obj.WidthInBytes,
                                                   _rows(desc._obj.dstDevice, desc._obj.dstPitch, desc._obj),
                                                   _rows(desc._obj.srcDevice, desc._obj.srcPitch, desc._obj))),
        "cuEventCreate": lambda ev, flags: 0,  # runtimes number their own events (_new_event)
        "cuEventRecord": record,
        "cuStreamWaitEvent": lambda s, e, f: put(s, ("wait_event", e, instances.get((active["rank"], e), 0))),
    }


@contextlib.contextmanager
def faked_cuda(runtimes: list[symm.GroupRuntime], queue: list | None = None):
    """Within: symm.runtime() is the active rank's runtime (`active(rank)` switches), the
    driver records into `queue`, torch.cuda.current_stream() is the rank's compute stream, and
    torch calls writing into a symmetric buffer are recorded as stores (not when `queue` is None)."""
    state = {"rank": 0, "streams": [], "quiet": 0}

    def active(rank: int) -> None:
        state["rank"] = rank

    entry_points = _entry_points(queue, state)
    with contextlib.ExitStack() as stack:
        # no watchdog marks (host-mapped memory) in the recorded protocol: test_watchdog.py has them;
        # every call through the Python host code: test_host_replay.py replays them
        stack.enter_context(mock.patch.dict(os.environ, {env.WATCHDOG: "0", env.HOST_REPLAY: "0"}))
        stack.enter_context(mock.patch.object(FakeStream, "driver_calls", entry_points))
        stack.enter_context(mock.patch.object(ce_a2a, "_sm_copy", _sm_copy_recorder(queue, state)))
        stack.enter_context(mock.patch.object(ce_exchange, "_read", _sm_copy_recorder(queue, state)))
        stack.enter_context(mock.patch.object(ce_exchange, "read_rows2", _run_read2_recorder(queue, state)))
        stack.enter_context(mock.patch.object(torch.Tensor, "record_stream", lambda self, stream: None))
        stack.enter_context(mock.patch.object(symm, "runtime", lambda *a, **k: runtimes[state["rank"]]))
        stack.enter_context(mock.patch.object(driver, "_lib", lambda: entry_points))
        stack.enter_context(mock.patch.object(driver, "_handle", _handle))
        stack.enter_context(mock.patch.object(driver, "current_handle",
                                              lambda *a, **k: runtimes[state["rank"]].compute.cuda_stream))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream",
                                              lambda *a, **k: runtimes[state["rank"]].compute))
        stack.enter_context(mock.patch.object(torch.cuda, "stream", _stream_context(state)))
        stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
        if queue is not None:
            stack.enter_context(_StoreRecorder(queue, state, runtimes))
        yield active
