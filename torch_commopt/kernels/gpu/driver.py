"""Stream memory operations of the CUDA driver (cuStreamWriteValue32 / cuStreamWaitValue32).

They run on the GPU's front end, not on SMs: a flag write queued behind a copy signals a
peer without a kernel, and a wait holds back a stream without a spinning block, so neither
can be starved by a persistent kernel that fills every SM.  The address may be a peer's
memory mapped through symmetric memory (NVLink P2P).
"""

from __future__ import annotations

import ctypes
import functools

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
    fns = {}
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns[name] = fn
    return fns


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"commopt: {what} failed with CUDA driver error {rc}")


def wait_value32(stream, address: int, value: int) -> None:
    """Hold `stream` until the uint32 at `address` is >= value (modulo 2**32)."""
    _check(_lib()["cuStreamWaitValue32"](stream.cuda_stream, address, value & 0xFFFFFFFF, WAIT_GEQ),
           "cuStreamWaitValue32")


def write_value32(stream, address: int, value: int) -> None:
    """Queue on `stream`: fence the stream's earlier writes, then store `value` at `address`."""
    _check(_lib()["cuStreamWriteValue32"](stream.cuda_stream, address, value & 0xFFFFFFFF, WRITE_FENCED),
           "cuStreamWriteValue32")
