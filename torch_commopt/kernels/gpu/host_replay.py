"""Eager GPU-schedule calls queued from a recorded host trace, in native code (TORCH_COMMOPT_HOST_REPLAY, on).

An eager call of a copy-engine schedule is host-bound at training sizes: its Python, ~15 driver
calls through ctypes and 2-6 cuBLAS launches through ATen cost 0.25-0.6 ms of host against
0.12-0.2 ms for NCCL + cuBLAS (benchmarks/bench_host.py), and a training step's forward waits for
that host (docs/gpu-schedules.md#host-cost).  Per-call CUDA graphs remove it only where the
call's tensors come back to the same addresses, which a training step's do not.

So a kind's first call runs as it is (it makes the symmetric views and buffers it uses) and its
second is recorded: every driver operation it queues (driver._tap) and every GEMM it runs (an ATen
mm / bmm / addmm_ / baddbmm_, seen by a dispatch mode; an add_ of two contiguous tensors becomes
cuBLAS's axpy), each device address written as an offset into one of the call's tensors or as an
absolute address (symmetric buffers, flags, host-mapped marks), and every launch of our native
kernels (driver.native_call: the sm_90a fused GEMMs) with its argument words.  The third is
recorded again and must give the same trace, but for values that are each recording's own epoch
(a barrier's, a kernel's argument): those are marked and replayed with the call's epoch; any
other difference refuses the kind.  From the fourth call on, native/replay.c queues the trace
with this call's tensor addresses and epoch, one ctypes call: the same driver operations, the
same launches and the same cuBLAS GEMMs (cublasGemmEx / cublasGemmStridedBatchedEx with the
parameters ATen passes for those layouts), no Python per operation.  "The same kind": op,
schedule, scalars, buffer half, caller stream, whether the watchdog watches it, which stream gives
the tokens back (env.tokens_on_side), and every tensor's shape, strides and dtype
(env.gather_own_early too: it queues the own rows' copy elsewhere).

Any other device work in a recorded call (an elementwise op, an allocation, a Triton launch:
refused by schedule name, or said by driver.untapped) makes the kind Python-only for the
process, logged once.  Replayed calls keep the protocol: the runtime counts the call
(next_epoch), the watchdog registers it and its recorded waits (their epochs this call's), and
its end mark carries this call's number.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import threading
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_commopt.core import env
from torch_commopt.kernels.gpu import driver

log = logging.getLogger("torch_commopt.kernels.gpu.host_replay")

WORDS = 24  # int64 words per step (replay.c)
KINDS = {"memcpy": 1, "memcpy2d": 2, "record": 3, "wait_event": 4, "wait32": 5, "write32": 6, "batch": 7, "gemm": 8,
         "axpy": 9, "call": 10}
# Schedules whose calls queue only driver operations and cuBLAS GEMMs; `fused` ones too with
# impl=sm90, whose kernels are native launchers (driver.native_call) -- where those fall back to a
# Triton kernel, which no tap sees, the recording says so and the kind is not replayed.
SCHEDULES = ("ce_push", "ce_pull", "direct")
EPOCH_BASE = -1  # replay.c's relocation of a launcher's word to the call's epoch
CUDA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # cudaDataType: CUDA_R_16BF, CUDA_R_16F
WORKSPACE_BYTES = 32 << 20  # cuBLAS workspace per handle, as ATen's on sm_90
SOURCE = pathlib.Path(__file__).with_name("native") / "replay.c"


class _Epoch:
    """The mark of a recorded value that is the call's epoch (it changed with the epoch between the
    kind's two recordings): replay.c writes each call's own there."""

    def __repr__(self) -> str:
        return "EPOCH"


EPOCH = _Epoch()


class Trace(NamedTuple):
    """A recorded call ready to replay: the encoded steps, the arrays they point to (kept alive),
    the watchdog waits the call declared (a value EPOCH: the call's epoch), and its end mark's
    address (0: none)."""

    steps: ctypes.Array
    count: int
    arrays: list
    waits: list
    end: int


_state: dict = {"lib": None, "why": None, "handles": {}, "workspaces": []}
STATS = {"python": 0, "recorded": 0, "replayed": 0}  # eager calls of eligible schedules, by how they ran
MAX_KINDS = 4096  # kinds remembered; past it, new kinds are not recorded (logged once)
_SEEN = object()  # a kind whose first call ran (made the symmetric views and buffers it uses): record the next
_kinds: dict[tuple, object] = {}  # kind -> _SEEN | its first recording (a tuple) | Trace | why not replayed (str)


def eligible(sched) -> bool:
    """Whether this call of `sched` goes through `call`: not under bounded waits (their kernels are
    Triton launches), nor under a dispatch mode of the caller's (a FLOP counter, a debug mode: a
    replayed call's GEMMs would bypass it)."""
    return (env.host_replay() and replayable(sched) and not sched.param("dbg", 0)
            and not env.debug_waits() and torch._C._len_torch_dispatch_stack() == 0)


def replayable(sched) -> bool:
    """Whether `sched`'s eager calls may be replayed (SCHEDULES)."""
    return sched.name in SCHEDULES or (sched.name == "fused" and sched.param("impl") == "sm90")


def _compile() -> pathlib.Path:
    source = SOURCE.read_bytes()
    out = env.cache_dir() / "native" / f"replay_{hashlib.sha256(source).hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise OSError("no C compiler (cc, gcc) on PATH")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE)], check=True,
                       capture_output=True, timeout=120)
        tmp.replace(out)
    return out


def load(entry_points: list[int] | None = None):
    """The native library with its entry points set (the driver's and cuBLAS's, or `entry_points`:
    addresses in replay.c's F_* order, a test's fakes); None when it cannot be built (logged once)."""
    if _state["lib"] is None and _state["why"] is None:
        try:
            lib = ctypes.CDLL(str(_compile()))
        except (OSError, subprocess.SubprocessError) as e:
            _state["why"] = f"the native replay library could not be built or loaded: {e}"
            log.warning("commopt: %s; eager calls run their Python host code", _state["why"])
            return None
        lib.commopt_replay.restype = ctypes.c_int64
        lib.commopt_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32,
                                       ctypes.c_uint32]
        _state["lib"] = lib
        _state["set"] = False
    lib = _state["lib"]
    if lib is not None and (entry_points is not None or not _state["set"]):
        try:
            points = entry_points if entry_points is not None else _cuda_entry_points()
        except Exception as e:  # noqa: BLE001 - no cuBLAS or driver entry point: say so, run Python
            _state["lib"], _state["why"] = None, f"the driver's or cuBLAS's entry points were not found: {e}"
            log.warning("commopt: %s; eager calls run their Python host code", _state["why"])
            return None
        lib.commopt_replay_init((ctypes.c_void_p * len(points))(*points))
        _state["set"] = True
    return lib


def _cublas():
    """The cuBLAS library torch loaded (torch.cuda.current_blas_handle loads it)."""
    lib = _state.get("cublas")
    if lib is None:
        torch.cuda.current_blas_handle()
        paths = {line.split()[-1] for line in pathlib.Path("/proc/self/maps").read_text().splitlines()
                 if "/libcublas.so" in line}
        if not paths:
            raise OSError("libcublas is not loaded in this process")
        lib = _state["cublas"] = ctypes.CDLL(sorted(paths)[0])
    return lib


def _cuda_entry_points() -> list[int]:
    fns, blas = driver._lib(), _cublas()
    names = ["cuMemcpyDtoDAsync", "cuMemcpy2DAsync", "cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue32",
             "cuStreamWriteValue32", "cuStreamBatchMemOp"]
    points = [ctypes.cast(fns[n], ctypes.c_void_p).value for n in names]
    points += [ctypes.cast(getattr(blas, n), ctypes.c_void_p).value
               for n in ("cublasSetStream_v2", "cublasGemmEx", "cublasGemmStridedBatchedEx", "cublasAxpyEx")]
    return points


def blas_handle(stream: int, dtype: torch.dtype, device: torch.device) -> int:
    """A cuBLAS handle of ours for GEMMs on `stream` (its own workspace: handles on two streams
    never share one), in ATen's math mode for `dtype`."""
    key = (stream, dtype)
    handle = _state["handles"].get(key)
    if handle is None:
        blas, h = _cublas(), ctypes.c_void_p()
        with torch.cuda.device(device):  # the handle's device is the current one
            _check_blas(blas.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        work = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _state["workspaces"].append(work)
        _check_blas(blas.cublasSetStream_v2(h, ctypes.c_void_p(stream)), "cublasSetStream")
        _check_blas(blas.cublasSetWorkspace_v2(h, ctypes.c_void_p(work.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES)),
                    "cublasSetWorkspace")
        reduced = (torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction if dtype == torch.bfloat16
                   else torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)
        _check_blas(blas.cublasSetMathMode(h, 0 if reduced else 16), "cublasSetMathMode")  # 16: disallow reduced
        handle = _state["handles"][key] = h.value
    return handle


def _check_blas(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"commopt: {what} failed with cuBLAS status {rc}")


# ---- recording ------------------------------------------------------------------------------
_GEMMS = {torch.ops.aten.mm.out: "out", torch.ops.aten.bmm.out: "out", torch.ops.aten.addmm_.default: "self",
          torch.ops.aten.baddbmm_.default: "self"}


class _Tap(TorchDispatchMode):
    """During a recorded call: each GEMM appended to `ops` (as replay.c's parameters, or the reason
    it cannot be replayed), any other device work noted in `refused`; everything still runs."""

    def __init__(self, ops: list, device: torch.device):
        super().__init__()
        self.ops, self.device, self.refused = ops, device, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS:
            self.ops.append(_gemm(func, args, kwargs, driver.current_handle(self.device)))
        elif func is torch.ops.aten.add_.Tensor:
            self.ops.append(_axpy(args, kwargs, driver.current_handle(self.device)))
        elif not func.is_view and self.refused is None:
            self.refused = f"the call runs {func} besides its GEMMs"
        return func(*args, **kwargs)


def _gemm(func, args, kwargs, stream: int):
    """("gemm", stream, dtype, ...) with cuBLAS's column-major parameters of out = beta * out +
    alpha * A @ B (out row-major: cuBLAS computes out^T = B^T A^T, as ATen does), or a str: why not."""
    if _GEMMS[func] == "out":
        a, b, c, alpha, beta = args[0], args[1], kwargs["out"], 1.0, 0.0
    else:
        c, a, b = args[0], args[1], args[2]
        alpha, beta = float(kwargs.get("alpha", 1.0)), float(kwargs.get("beta", 1.0))
    if not (a.dtype == b.dtype == c.dtype) or a.dtype not in CUDA_TYPES:
        return f"a GEMM in {a.dtype} / {b.dtype} -> {c.dtype}"
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    first, second = _operand(b, n, k), _operand(a, k, m)
    c0, c1 = c.stride()[-2:]
    if first is None or second is None or c1 != 1 or c0 < max(1, n):
        return f"a GEMM layout cuBLAS takes only through a copy (A {a.stride()}, B {b.stride()}, out {c.stride()})"
    batch = c.shape[0] if c.dim() == 3 else 0
    strides = [t.stride(0) if batch else 0 for t in (b, a, c)]
    return ("gemm", stream, a.dtype, first[0], second[0], n, m, k, b.data_ptr(), first[1], strides[0],
            a.data_ptr(), second[1], strides[1], c.data_ptr(), c0, strides[2], batch, alpha, beta)


def _axpy(args, kwargs, stream: int):
    """("axpy", stream, dtype, n, x, y, alpha): self.add_(other, alpha) of two contiguous tensors of
    one shape and dtype as cuBLAS's y += alpha * x in fp32 (ATen's own arithmetic), or why not."""
    y, x = args[0], args[1]
    if not (isinstance(x, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype in CUDA_TYPES
            and x.is_contiguous() and y.is_contiguous()):
        return "an add of other than two contiguous bf16/fp16 tensors of one shape"
    return ("axpy", stream, y.dtype, y.numel(), x.data_ptr(), y.data_ptr(), float(kwargs.get("alpha", 1.0)))


def _operand(t: torch.Tensor, rows: int, cols: int):
    """(transpose, leading dim) of t's last two dims read as a column-major rows x cols matrix
    (cuBLAS's operand), None when neither layout fits."""
    s0, s1 = t.stride()[-2:]
    if s1 == 1 and s0 >= max(1, rows):
        return 0, s0
    if s0 == 1 and s1 >= max(1, cols):
        return 1, s1
    return None


def _extent(t: torch.Tensor | None):
    if t is None or t.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _where(ptr: int, extents: list):
    """(base, offset) of a device address: base i >= 1 the call's tensor i-1 holding it, 0 absolute;
    None when two tensors hold it."""
    hits = [i for i, e in enumerate(extents) if e is not None and e[0] <= ptr < e[1]]
    if len(hits) > 1:
        return None
    return (hits[0] + 1, ptr - extents[hits[0]][0]) if hits else (0, ptr)


# where each tapped operation holds device addresses (the tuple positions _relocate rewrites)
_ADDRESSES = {"memcpy": (2, 3), "memcpy2d": (2, 4), "wait32": (2,), "write32": (2,), "gemm": (8, 11, 14),
              "axpy": (4, 5)}


def _relocate(ops: list, tensors) -> list | str:
    """The tapped operations with every device address as (base, offset) (`_where`), or why not."""
    extents = [_extent(t) for t in tensors]
    out = []
    for op in ops:
        if isinstance(op, str):
            return op
        kind = op[0]
        if kind == "batch_array":
            return "a prepared batch (a captured call's start marks)"
        if kind == "batch":
            if any(_where(addr, extents) != (0, addr) for _, addr, _ in op[2]):
                return "a flag batch writes into the call's tensors"
            out.append(op)
            continue
        if kind == "call":
            step = _relocated_call(op, extents)
            if step is None:
                return "an address inside two of the call's tensors"
            out.append(step)
            continue
        step = list(op)
        for i in _ADDRESSES.get(kind, ()):
            step[i] = _where(op[i], extents)
            if step[i] is None:
                return "an address inside two of the call's tensors"
        out.append(tuple(step))
    return out


def _relocated_call(op: tuple, extents: list) -> tuple | None:
    """("call", stream, launcher, words, relocations) of a tapped native_call: each address word
    inside one of the call's tensors as its offset there, with (word index, tensor base) in
    relocations, the others kept absolute; None when an address is inside two tensors."""
    _, stream, fn, words, addresses = op
    words, relocations = list(words), []
    for i in addresses:
        where = _where(words[i], extents)
        if where is None:
            return None
        if where[0]:
            words[i] = where[1]
            relocations.append((i, where[0]))
    return ("call", stream, fn, tuple(words), tuple(relocations))


class _Differs(Exception):
    """Two recordings of a kind differ in more than the call's epoch."""


def _marked(first, second, epochs: tuple):
    """`second` (a recording, or any part of one) with each value that is epochs[0] in `first` and
    epochs[1] in `second` -- the recordings' epochs -- marked EPOCH; _Differs where the two
    differ otherwise."""
    if first == second:
        return second
    if isinstance(first, (tuple, list)) and type(first) is type(second) and len(first) == len(second):
        return type(second)(_marked(x, y, epochs) for x, y in zip(first, second))
    if isinstance(first, int) and isinstance(second, int) and (first, second) == epochs:
        return EPOCH
    raise _Differs


# ---- packing and replaying ------------------------------------------------------------------
def _bits(x: float) -> int:
    return ctypes.c_int32.from_buffer(ctypes.c_float(x)).value


def _words(step: tuple, device: torch.device, arrays: list) -> list[int]:
    kind, stream = step[0], step[1]
    head = [KINDS[kind], stream]
    if kind == "memcpy":
        return head + [*step[2], *step[3], step[4]]
    if kind == "memcpy2d":
        return head + [*step[2], *step[4], step[3], step[5], step[6], step[7]]
    if kind in ("record", "wait_event"):
        return head + [step[2]]
    if kind in ("wait32", "write32"):
        return head + [*step[2], 0, 1] if step[3] == EPOCH else head + [*step[2], step[3], 0]
    if kind == "batch":
        ops = step[2]
        if any(value == EPOCH for _, _, value in ops[64:]):
            raise ValueError("an epoch past a batch's 64th operation")
        # the trace's own array: replay.c writes its last value and its epochs
        params = driver.batch_params([(op, addr, 0 if value == EPOCH else value) for op, addr, value in ops])
        arrays.append(params)
        mask = sum(1 << i for i, (_, _, value) in enumerate(ops) if value == EPOCH)
        return head + [ctypes.addressof(params), len(ops), int(step[3]), mask]
    if kind == "call":
        return head + _call_words(step, arrays)
    if kind == "axpy":
        (_, _, dtype, n, x, y, alpha) = step
        return head + [blas_handle(stream, dtype, device), n, *x, *y, CUDA_TYPES[dtype], _bits(alpha)]
    (_, _, dtype, opa, opb, m, n, k, a, lda, sa, b, ldb, sb, c, ldc, sc, batch, alpha, beta) = step
    handle = blas_handle(stream, dtype, device)
    return head + [handle, opa, opb, m, n, k, *a, lda, sa, *b, ldb, sb, *c, ldc, sc, batch, CUDA_TYPES[dtype],
                   _bits(alpha), _bits(beta)]


def _call_words(step: tuple, arrays: list) -> list[int]:
    """A native launcher's step: its address, its argument words and their relocations (replay.c's
    CALL), each word that is the call's epoch relocated to it."""
    _, _, fn, words, relocations = step
    epochs = [(i, EPOCH_BASE) for i, w in enumerate(words) if w == EPOCH]
    template = (ctypes.c_int64 * len(words))(*(0 if w == EPOCH else w for w in words))
    pairs = [x for pair in (*relocations, *epochs) for x in pair]
    table = (ctypes.c_int64 * max(1, len(pairs)))(*pairs)
    arrays += [template, table]
    return [fn, ctypes.addressof(template), len(words), ctypes.addressof(table), len(pairs) // 2]


def pack(steps: list, waits: list, end: int, device: torch.device) -> Trace:
    """The steps encoded for replay.c (a batch's last value as a flag: _comparable's form); raises
    ValueError where an epoch sits where replay.c takes none."""
    arrays: list = []
    flat: list[int] = []
    for step in steps:
        words = _words(step, device, arrays)
        if any(w == EPOCH for w in words):
            raise ValueError(f"an epoch in a {step[0]} step")
        flat += words + [0] * (WORDS - len(words))
    return Trace((ctypes.c_int64 * max(1, len(flat)))(*flat), len(steps), arrays, waits, end)


def _comparable(steps: list) -> list:
    """A batch's last value is the call's own (the watchdog's number): only whether it has one is
    part of the comparison."""
    return [s[:3] + (s[3] is not None,) if s[0] == "batch" else s for s in steps]


def call(op: str, sched, rt, tensors: tuple, scalars: tuple, body) -> None:
    """body() of one eager call, watched (begin_eager / end_call) -- recorded, or replayed from
    its kind's trace (module docstring)."""
    handle, watch = driver.current_handle(rt.device), env.watch_calls()  # (eligible: no dbg=1 schedule)
    key = (op, rt.group_name, str(sched), scalars, handle, (rt.epoch + 1) % 2,
           watch, env.tokens_on_side(), env.gather_own_early()) + tuple(
               None if t is None else (t.shape, t.stride(), t.dtype) for t in tensors)
    known = _kinds.get(key)
    watched = rt.begin_eager(op, sched, handle) if watch else None  # (call_graphs.call: never under a capture)
    rt.watch = watched
    try:
        if isinstance(known, Trace):
            if known.end and (watched is None or watched.end != known.end):  # its end mark rides elsewhere
                body()
            else:
                _replay(known, tensors, watched, rt.next_epoch())
                STATS["replayed"] += 1
                return
        elif isinstance(known, str) or known is None:  # a kind's first call makes its views and buffers
            if known is None and len(_kinds) < MAX_KINDS:
                _kinds[key] = _SEEN
            elif known is None and not _state.get("full"):
                _state["full"] = True
                log.warning("commopt: %d kinds of eager calls recorded (shapes that keep changing?): new kinds "
                            "run their Python host code", MAX_KINDS)
            body()
        else:
            _record(key, known, rt, tensors, body)
            STATS["recorded"] += 1
            return
        STATS["python"] += 1
    finally:
        rt.watch = None
        rt.end_call(watched)


def _record(key: tuple, first, rt, tensors: tuple, body) -> None:
    """body() with its operations tapped; the kind's first recording kept, the second compared
    with it and packed (or the reason it is not replayed, logged)."""
    ops: list = []
    tap = _Tap(ops, rt.device)
    driver._tap, driver._tap_thread = ops, threading.get_ident()
    try:
        with tap:
            body()
    finally:
        driver._tap = None
    try:  # the call has run: whatever goes wrong from here costs the kind its replay, not the call
        _settle(key, first, rt, tensors, (ops, tap.refused, rt.epoch))
    except Exception as e:  # noqa: BLE001
        _refuse(key, f"its recording failed: {type(e).__name__}: {e}")


def _settle(key: tuple, first, rt, tensors: tuple, tapped: tuple) -> None:
    """A recording's outcome: kept as the kind's first, packed as its trace (the values that
    changed with the call's epoch between the two recordings marked EPOCH), or refused."""
    ops, refused, epoch = tapped
    watched = rt.watch
    blas = torch.backends.cuda.preferred_blas_library()
    if not refused and blas.name != "Cublas":  # replay.c calls cuBLAS as ATen's default backend does
        refused = f"ATen's GEMMs run through {blas.name} (torch.backends.cuda.preferred_blas_library)"
    steps = refused or _relocate(ops, tensors)
    waits = list(watched.waits) if watched is not None else []
    end = watched.end if watched is not None and watched.ended else 0
    if isinstance(steps, str):
        _refuse(key, steps)
    elif first is _SEEN:
        _kinds[key] = (steps, waits, end, epoch)
    elif end != first[2]:
        _refuse(key, "its end mark changed from one call to the next")
    else:
        try:
            marked = _marked((_comparable(first[0]), first[1]), (_comparable(steps), waits), (first[3], epoch))
        except _Differs:
            _refuse(key, "its operations changed from one call to the next in more than the call's epoch")
            return
        if load() is None:
            _refuse(key, _state["why"])
        else:
            _kinds[key] = pack(*marked, end, rt.device)


def refusals() -> list[str]:
    """'op schedule: why' for every (op, schedule) with a kind that is not replayed (a run's summary)."""
    return sorted({f"{key[0]} {key[2]}: {why}" for key, why in _kinds.items() if isinstance(why, str)})


def _refuse(key: tuple, why: str) -> None:
    _kinds[key] = why
    log.info("commopt %s %s: eager calls of this kind run their Python host code, not a replay (%s)",
             key[0], key[2], why)


def _replay(trace: Trace, tensors: tuple, watched, epoch: int) -> None:
    bases = (ctypes.c_int64 * (len(tensors) + 1))(0, *[0 if t is None else t.data_ptr() for t in tensors])
    rc = _state["lib"].commopt_replay(ctypes.addressof(trace.steps), trace.count, bases,
                                      watched.value & 0xFFFFFFFF if watched is not None else 0, epoch & 0xFFFFFFFF)
    if rc:
        raise RuntimeError(f"commopt: replaying a call's host trace failed at step {(rc >> 32) - 1} "
                           f"with error {rc & 0xFFFFFFFF}")
    if watched is not None:
        watched.waits.extend(w if EPOCH not in w else tuple(epoch if v == EPOCH else v for v in w)
                             for w in trace.waits)
        watched.ended = watched.ended or bool(trace.end)
