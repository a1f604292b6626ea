"""The native host replay's entry points (kernels/gpu/native/replay.c) bound to fake_cuda's recorded
driver and to a cuBLAS stand-in that multiplies CPU memory, so a replayed call's queue and
products can be compared with those of the Python host code on the CPU."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import torch

from torch_commopt.kernels.gpu import driver

_DTYPES = {14: torch.bfloat16, 2: torch.float16}
P, U64, I32, I64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_longlong


def _matrix(ptr: int, dtype, shape: tuple, strides: tuple) -> torch.Tensor:
    """A CPU tensor over raw memory at `ptr` with these sizes and strides (elements)."""
    span = sum((s - 1) * st for s, st in zip(shape, strides)) + 1
    size = torch.tensor([], dtype=dtype).element_size()
    raw = torch.frombuffer((ctypes.c_char * (span * size)).from_address(ptr), dtype=dtype)
    return raw.as_strided(shape, strides)


def _op(ptr: int, dtype, trans: int, rows: int, cols: int, ld: int, batch: int, stride: int) -> torch.Tensor:
    """cuBLAS's op(X) as a (batch, rows, cols) tensor: X column-major with leading dim ld."""
    strides = (1, ld) if trans == 0 else (ld, 1)
    return _matrix(ptr, dtype, (batch, rows, cols), (stride, *strides))


def _gemm(transa, transb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch, dtype):
    dtype = _DTYPES[dtype]
    x = _op(a, dtype, transa, m, k, lda, batch, sa).float()
    y = _op(b, dtype, transb, k, n, ldb, batch, sb).float()
    out = _matrix(c, dtype, (batch, m, n), (sc, 1, ldc))
    alpha, beta = ctypes.c_float.from_address(alpha).value, ctypes.c_float.from_address(beta).value
    result = alpha * (x @ y) + (beta * out.float() if beta else 0.0)
    out.copy_(result.to(dtype))
    return 0


def entry_points(fake: dict, gemms: list) -> tuple[list[int], list]:
    """(addresses in replay.c's F_* order, the callbacks to keep alive); `fake`: faked_cuda's
    driver entry points; each GEMM's (m, n, k, batch) is appended to `gemms`."""
    def memcpy2d(desc, stream):
        return fake["cuMemcpy2DAsync"](SimpleNamespace(_obj=driver._Memcpy2D.from_address(desc)), stream)

    def batch(stream, count, params, flags):
        return fake["cuStreamBatchMemOp"](stream, count, (driver._BatchMemOp * count).from_address(params), flags)

    def gemm(h, ta, tb, m, n, k, al, a, at, lda, b, bt, ldb, be, c, ct, ldc, comp, algo):
        gemms.append((m, n, k, 0))
        return _gemm(ta, tb, m, n, k, al, a, lda, 0, b, ldb, 0, be, c, ldc, 0, 1, at)

    def gemm_batched(h, ta, tb, m, n, k, al, a, at, lda, sa, b, bt, ldb, sb, be, c, ct, ldc, sc, count, comp, algo):
        gemms.append((m, n, k, count))
        return _gemm(ta, tb, m, n, k, al, a, lda, sa, b, ldb, sb, be, c, ldc, sc, count, at)

    def axpy(h, n, alpha, alpha_type, x, xt, incx, y, yt, incy, exec_type):
        gemms.append(("axpy", n))
        xs, ys = _matrix(x, _DTYPES[xt], (n,), (incx,)), _matrix(y, _DTYPES[yt], (n,), (incy,))
        ys.copy_((ys.float() + ctypes.c_float.from_address(alpha).value * xs.float()).to(ys.dtype))
        return 0

    value = ctypes.CFUNCTYPE(I32, U64, U64, ctypes.c_uint32, ctypes.c_uint)
    callbacks = [
        ctypes.CFUNCTYPE(I32, U64, U64, ctypes.c_size_t, U64)(lambda d, s, n, st: fake["cuMemcpyDtoDAsync"](d, s, n, st)),
        ctypes.CFUNCTYPE(I32, P, U64)(memcpy2d),
        ctypes.CFUNCTYPE(I32, U64, U64)(lambda ev, st: fake["cuEventRecord"](ev, st)),
        ctypes.CFUNCTYPE(I32, U64, U64, ctypes.c_uint)(lambda st, ev, f: fake["cuStreamWaitEvent"](st, ev, f)),
        value(lambda st, a, v, f: fake["cuStreamWaitValue32"](st, a, v, f)),
        value(lambda st, a, v, f: fake["cuStreamWriteValue32"](st, a, v, f)),
        ctypes.CFUNCTYPE(I32, U64, ctypes.c_uint, P, ctypes.c_uint)(batch),
        ctypes.CFUNCTYPE(I32, P, P)(lambda h, st: 0),
        ctypes.CFUNCTYPE(I32, P, I32, I32, I32, I32, I32, P, P, I32, I32, P, I32, I32, P, P, I32, I32, I32, I32)(gemm),
        ctypes.CFUNCTYPE(I32, P, I32, I32, I32, I32, I32, P, P, I32, I32, I64, P, I32, I32, I64, P, P, I32, I32, I64,
                         I32, I32, I32)(gemm_batched),
        ctypes.CFUNCTYPE(I32, P, I32, P, I32, P, I32, I32, P, I32, I32, I32)(axpy),
    ]
    return [ctypes.cast(cb, ctypes.c_void_p).value for cb in callbacks], callbacks


def named(queue: list, outs: list) -> list:
    """The queue with every address inside an output named (call, output, offset): outputs are
    allocated per call, at other addresses in another run."""
    extents = [(i, j, o.data_ptr(), o.data_ptr() + o.numel() * o.element_size())
               for i, call_outs in enumerate(outs) for j, o in enumerate(call_outs)]

    def name(x):
        if isinstance(x, tuple):
            return tuple(name(y) for y in x)
        if isinstance(x, int) and not isinstance(x, bool):
            for i, j, lo, hi in extents:
                if lo <= x <= hi:
                    return ("out", i, j, x - lo)
        return x
    return [name(op) for op in queue]


def forget_kinds(monkeypatch, tmp_path) -> None:
    """host_replay as in a fresh process: no kind known, no library loaded (built under tmp_path,
    its entry points set by the test), no cuBLAS handle needed."""
    from torch_commopt.core import env
    from torch_commopt.kernels.gpu import host_replay

    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(host_replay, "_kinds", {})
    monkeypatch.setattr(host_replay, "_state", {"lib": None, "why": None, "handles": {}, "workspaces": []})
    monkeypatch.setattr(host_replay, "blas_handle", lambda stream, dtype, device: 1)
