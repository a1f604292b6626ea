"""Stream memory operations of the CUDA driver (cuStreamWriteValue32 / cuStreamWaitValue32),
copies by the copy engine (cuMemcpyDtoDAsync, cuMemcpy2DAsync) and events between streams
(cuEventRecord / cuStreamWaitEvent).

They run on the GPU's front end, not on SMs: a flag write queued behind a copy signals a
peer without a kernel, and a wait holds back a stream without a spinning block, so neither
can be starved by a persistent kernel that fills every SM.  The address may be a peer's
memory mapped through symmetric memory (NVLink P2P).

They are also the cheaper way for the host to queue work: a schedule's call queues tens of
these.  Under cProfile on a 2x H200 host, in a training step: a peer copy 14 us, a flag wait
or write 5-8 us, an event record 6 us through ctypes, where the same steps through torch cost
31 us (`Tensor.copy_` into a peer's tensor on a side stream) and 11 us (`torch.cuda.Event`
record + wait), plus the stream contexts around them.
Every function takes a stream as a torch stream or its raw handle (int).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

# cuStreamWaitValue32 flags: (int32)(*addr - value) >= 0, i.e. wrap-around safe epochs.
WAIT_GEQ = 0x0
# cuStreamWriteValue32 flags: default = preceded by a fence over the stream's earlier writes.
WRITE_FENCED = 0x0


@functools.cache
def _lib():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # pragma: no cover - only on a machine without the driver
        raise RuntimeError(f"commopt: the CUDA driver library is not loadable: {e}") from e
    value_op = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    signatures = {
        "cuStreamWaitValue32": value_op,
        "cuStreamWriteValue32": value_op,
        "cuMemcpy2DAsync": [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p],
        "cuMemcpyDtoDAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuEventCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
        "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
        "cuStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
        "cuStreamBatchMemOp": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint],
        "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
        "cuMemHostGetDevicePointer": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint],
        "cuMemcpyDtoHAsync": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuStreamQuery": [ctypes.c_void_p],
        "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuThreadExchangeStreamCaptureMode": [ctypes.POINTER(ctypes.c_int)],
    }
    fns = {}
    for name, argtypes in signatures.items():  # the versioned entry point where there is one
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        fns[name] = fn
    return fns


# kernels/gpu/host_replay.py's recording of one call: while a list, every operation the recording
# thread (_tap_thread) queues is appended to it as (kind, stream handle, *arguments) first.
_tap: list | None = None
_tap_thread = 0


def _note(op: tuple | str) -> None:
    if threading.get_ident() == _tap_thread:  # not the watchdog thread's releases
        _tap.append(op)


def _handle(stream) -> int:
    return stream if isinstance(stream, int) else stream.cuda_stream


def current_handle(device) -> int:
    """The raw handle of `device`'s current stream, without the torch Stream object that
    torch.cuda.current_stream() builds (a few microseconds on a per-call path)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


_MEMORY_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


def memcpy2d_async(stream, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> None:
    """Queue on `stream` a copy of `height` rows of `width` bytes, row r from src + r*src_pitch
    to dst + r*dst_pitch (device addresses; a peer's memory mapped through symmetric memory is
    one): a DMA on the copy engine, no SM."""
    if height == 0 or width == 0:
        return
    if _tap is not None:
        _note(("memcpy2d", _handle(stream), dst, dst_pitch, src, src_pitch, width, height))
    desc = _Memcpy2D(srcMemoryType=_MEMORY_DEVICE, srcDevice=src, srcPitch=src_pitch,
                     dstMemoryType=_MEMORY_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                     WidthInBytes=width, Height=height)
    _check(_lib()["cuMemcpy2DAsync"](ctypes.byref(desc), _handle(stream)), "cuMemcpy2DAsync")


def memcpy_async(stream, dst: int, src: int, nbytes: int) -> None:
    """Queue on `stream` a copy of `nbytes` contiguous bytes from device address src to dst
    (the copy engine; either side may be a peer's symmetric memory)."""
    if nbytes:
        if _tap is not None:
            _note(("memcpy", _handle(stream), dst, src, nbytes))
        _check(_lib()["cuMemcpyDtoDAsync"](dst, src, nbytes, _handle(stream)), "cuMemcpyDtoDAsync")


_EVENT_DISABLE_TIMING = 0x2


def event_create() -> int:
    """A new CUDA event (no timing), as its raw handle; kept for the process's lifetime."""
    ev = ctypes.c_void_p()
    _check(_lib()["cuEventCreate"](ctypes.byref(ev), _EVENT_DISABLE_TIMING), "cuEventCreate")
    return ev.value


def record(event: int, stream) -> None:
    """cuEventRecord: the event completes once `stream`'s work queued so far is done."""
    if _tap is not None:
        _note(("record", _handle(stream), event))
    _check(_lib()["cuEventRecord"](event, _handle(stream)), "cuEventRecord")


def wait_event(waiter, event: int) -> None:
    """cuStreamWaitEvent: `waiter`'s later work waits for the event's latest record."""
    if _tap is not None:
        _note(("wait_event", _handle(waiter), event))
    _check(_lib()["cuStreamWaitEvent"](_handle(waiter), event, 0), "cuStreamWaitEvent")


def stream_after(waiter, event: int, stream) -> None:
    """`waiter` runs nothing queued after this call before `stream`'s work queued so far is
    done (the event may be recorded again as soon as this returns)."""
    record(event, stream)
    wait_event(waiter, event)


class _BatchMemOp(ctypes.Structure):
    """CUstreamBatchMemOpParams for a 32-bit wait or write (the union is 48 bytes)."""

    _fields_ = [("operation", ctypes.c_uint), ("_pad0", ctypes.c_uint), ("address", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint), ("_pad1", ctypes.c_uint),
                ("alias", ctypes.c_uint64), ("_pad2", ctypes.c_uint64)]


assert ctypes.sizeof(_BatchMemOp) == 48
_OP_WAIT32, _OP_WRITE32 = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, CU_STREAM_MEM_OP_WRITE_VALUE_32
MAX_BATCH = 256  # the driver's limit on one batch


def batch(stream, ops, last: int | None = None) -> None:
    """Queue `ops` -- ("wait", address, value) (>=, as wait_value32) or ("write", address, value)
    (fenced, as write_value32) -- as ONE stream memory operation, executed in order.  Replayed
    from a CUDA graph it is one node where separate calls are one each, and every node on a
    stream's path costs the GPU's front end a few microseconds (docs/gpu-schedules.md).
    last: the value of the last operation instead of its own (a value that changes every call,
    e.g. the watchdog's call numbers, without a new cached array each call: the driver reads the
    array during the call only)."""
    ops = tuple(ops)
    if not ops:
        return
    params = _batch_params(ops)
    if _tap is not None:
        _note(("batch", _handle(stream), ops, last))
    if last is not None:
        params[len(ops) - 1].value = last & 0xFFFFFFFF
    _check(_lib()["cuStreamBatchMemOp"](_handle(stream), len(ops), params, 0), "cuStreamBatchMemOp")


@functools.lru_cache(maxsize=4096)
def _batch_params(ops: tuple) -> ctypes.Array:
    """The parameter array of a batch, built once per distinct batch: a schedule's calls repeat
    the same few (flag addresses and values are constants), and filling the ctypes structures
    would be most of `batch`'s host time.  The driver reads the array during the call, so one array
    serves every call (it is never written after it is built)."""
    if len(ops) > MAX_BATCH:
        raise ValueError(f"commopt: {len(ops)} memory operations in one batch, at most {MAX_BATCH}")
    params = (_BatchMemOp * len(ops))()
    for slot, (kind, address, value) in zip(params, ops):
        if kind not in ("wait", "write"):
            raise ValueError(f"commopt: unknown stream memory operation {kind!r}")
        slot.operation = _OP_WAIT32 if kind == "wait" else _OP_WRITE32
        slot.address, slot.value = address, value & 0xFFFFFFFF
        slot.flags = WAIT_GEQ if kind == "wait" else WRITE_FENCED
    return params


def batch_array(stream, params: ctypes.Array) -> None:
    """Queue a batch built by `batch_params` (or mutated since: the driver reads the array during
    the call only) as one stream memory operation."""
    if _tap is not None:
        _note(("batch_array", _handle(stream)))
    _check(_lib()["cuStreamBatchMemOp"](_handle(stream), len(params), params, 0), "cuStreamBatchMemOp")


def batch_params(ops) -> ctypes.Array:
    """A batch's parameter array of its own (not the shared cache of `batch`), for a caller that
    rewrites a value before each call (`params[i].value = ...`)."""
    return _batch_params.__wrapped__(tuple(ops))


_HOST_PORTABLE, _HOST_DEVICEMAP = 0x1, 0x2  # CU_MEMHOSTALLOC_*


def host_mapped(nbytes: int) -> tuple[int, int]:
    """(host address, device address) of nbytes of pinned host memory, zeroed, mapped into every
    context (portable) so that the GPU's stream memory operations write it and the host reads it
    without a CUDA call.  Kept for the process's lifetime."""
    host = ctypes.c_void_p()
    _check(_lib()["cuMemHostAlloc"](ctypes.byref(host), nbytes, _HOST_PORTABLE | _HOST_DEVICEMAP), "cuMemHostAlloc")
    ctypes.memset(host.value, 0, nbytes)
    dev = ctypes.c_uint64()
    _check(_lib()["cuMemHostGetDevicePointer"](ctypes.byref(dev), host.value, 0), "cuMemHostGetDevicePointer")
    return host.value, dev.value


def memcpy_dtoh_async(stream, host: int, src: int, nbytes: int) -> None:
    """Queue on `stream` a copy of nbytes from device address src into pinned host memory at `host`."""
    _check(_lib()["cuMemcpyDtoHAsync"](host, src, nbytes, _handle(stream)), "cuMemcpyDtoHAsync")


def current_context() -> int:
    """The calling thread's current CUDA context (a handle; 0: none)."""
    ctx = ctypes.c_void_p()
    _check(_lib()["cuCtxGetCurrent"](ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


def use_context(ctx: int) -> None:
    """Make `ctx` the calling thread's current context: a thread of our own (the watchdog's) has
    none, and torch's device guard does not make one current when the device index already matches."""
    _check(_lib()["cuCtxSetCurrent"](ctx), "cuCtxSetCurrent")


_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED


def relax_capture_mode() -> None:
    """Let the calling thread make CUDA calls while another thread captures a CUDA graph.

    A capture in the default (global) mode -- torch.cuda.graph's, Inductor's CUDA-graph trees' --
    forbids "potentially unsafe" calls (a stream query, an asynchronous copy) in every other
    thread of the process: such a call fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) and
    invalidates the capture.  The watchdog's thread copies flags on a non-blocking stream of its
    own, which no capture touches: relaxed mode (per thread) lets it, and leaves the capture alone."""
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    _check(_lib()["cuThreadExchangeStreamCaptureMode"](ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")


def stream_done(stream) -> bool:
    """cuStreamQuery: whether every operation queued on `stream` has completed (no waiting)."""
    rc = _lib()["cuStreamQuery"](_handle(stream))
    if rc == _NOT_READY:
        return False
    _check(rc, "cuStreamQuery")
    return True


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"commopt: {what} failed with CUDA driver error {rc}")


def wait_value32(stream, address: int, value: int) -> None:
    """Hold `stream` until the uint32 at `address` is >= value (modulo 2**32)."""
    if _tap is not None:
        _note(("wait32", _handle(stream), address, value & 0xFFFFFFFF))
    _check(_lib()["cuStreamWaitValue32"](_handle(stream), address, value & 0xFFFFFFFF, WAIT_GEQ),
           "cuStreamWaitValue32")


def native_call(fn, words, addresses: tuple) -> int:
    """fn(words): a launcher of ours that takes its arguments as one int64 array (the sm_90a fused
    GEMMs, kernels/matmul/gpu/sm90.py), its status returned.  addresses: the indices of the words
    that hold device addresses (a recording relocates them into the call's tensors)."""
    if _tap is not None:
        _note(("call", 0, ctypes.cast(fn, ctypes.c_void_p).value, tuple(words), addresses))
    return fn((ctypes.c_int64 * len(words))(*words))


def untapped(what: str) -> None:
    """The caller queues work no tap sees (a Triton launch): a recording of this call is refused."""
    if _tap is not None:
        _note(f"the call {what}")


def write_value32(stream, address: int, value: int) -> None:
    """Queue on `stream`: fence the stream's earlier writes, then store `value` at `address`."""
    if _tap is not None:
        _note(("write32", _handle(stream), address, value & 0xFFFFFFFF))
    _check(_lib()["cuStreamWriteValue32"](_handle(stream), address, value & 0xFFFFFFFF, WRITE_FENCED),
           "cuStreamWriteValue32")
