"""The commopt custom ops (`torch.ops.commopt.*`): schemas, fake impls, dispatch to schedules.

Every op carries its schedule as a string (`Schedule.__str__`), so the rewritten graph
records the decision and the op runs it.  GPU schedules (`torch_commopt.kernels.gpu`,
imported on first use) run on CUDA tensors; the reference schedules in plain torch + c10d
run on any backend (gloo, NCCL, fake) and are the GPU schedules' twins elsewhere.
"""

# Custom-op signatures are their schema; everything below them takes value types.  The ops'
# definitions and fake impls keep every argument the compiled graphs pass (exempt from the
# eight-parameter rule: tests/test_house_rules.py, CUSTOM_OPS); the schedules they call take
# a Product (kernels/matmul/product.py) and the like.

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.core import env
from torch_commopt.core.groups import resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels import scaled
from torch_commopt.kernels.gpu.call_graphs import capturing
from torch_commopt.kernels.matmul import sequential
from torch_commopt.kernels.matmul.product import Product
from torch_commopt.kernels.matmul.reference.ag_matmul import ag_matmul_reference
from torch_commopt.kernels.matmul.reference.matmul_reduce import matmul_ar_reference, matmul_rs_reference

log = logging.getLogger("torch_commopt.kernels.matmul.ops")
_warned: set[tuple[str, str]] = set()

# Registered through torch.library.Library rather than torch.library.custom_op: the ops only
# appear in post-grad graphs (no autograd formula is needed), and custom_op's wrappers (autograd
# redispatch, alias checks, dynamo guard) cost ~10 us per call -- a tenth of a short call.
_LIB = torch.library.Library("commopt", "DEF")
_SCHEMAS = {
    "ag_matmul": "ag_matmul(Tensor a, Tensor[] weights, Tensor?[] biases, int gather_dim, int group_size, "
                 "str group_name, str schedule, bool return_gathered, Tensor? a_scale=None, Tensor[]? b_scales=None, "
                 "ScalarType? out_dtype=None, bool fast_accum=False) -> Tensor[]",
    "matmul_rs": "matmul_rs(Tensor a, Tensor weight, Tensor? bias, int scatter_dim, str reduce_op, int group_size, "
                 "str group_name, str schedule, Tensor? a_scale=None, Tensor? b_scale=None, ScalarType? out_dtype=None, "
                 "bool fast_accum=False, Tensor[]? more_a=None, Tensor[]? more_w=None) -> Tensor",
    "matmul_ar": "matmul_ar(Tensor a, Tensor weight, Tensor? bias, str reduce_op, int group_size, str group_name, "
                 "str schedule, Tensor? a_scale=None, Tensor? b_scale=None, ScalarType? out_dtype=None, "
                 "bool fast_accum=False, Tensor[]? more_a=None, Tensor[]? more_w=None) -> Tensor",
    "shard_rows": "shard_rows(Tensor x, int group_size, str group_name, bool check=False, int dim=0) -> Tensor",
    "replicated": "replicated(Tensor x, int group_size, str group_name) -> Tensor",
}


# TORCH_COMMOPT_HOST_TIMING=1 (core/env.py; read when the ops are registered, at import): every
# op call's host time is added up per (op, thread name): [calls, wall seconds, the thread's CPU
# seconds].  A CPU time below the wall time is time the thread was not running (descheduled, or
# blocked).
HOST_TIMES: dict[tuple[str, str], list] = collections.defaultdict(lambda: [0, 0.0, 0.0])


def _timed(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = HOST_TIMES[name, threading.current_thread().name]
            rec[0] += 1
            rec[1] += time.perf_counter() - t0
            rec[2] += time.thread_time() - c0
    return timed


def _op(name: str):
    """Define commopt::<name> with the decorated function as its kernel on every device."""
    def register(fn):
        _LIB.define(_SCHEMAS[name])
        _LIB.impl(name, _timed(name, fn) if env.host_timing() else fn,
                  "CompositeExplicitAutograd")
        return fn

    return register


@functools.lru_cache(maxsize=256)
def _parse(schedule: str) -> Schedule:
    return Schedule.parse(schedule)


# `autotune` placeholders whose first call decided -> the schedule they run from then on (a
# decision never changes within a process): each op looks its schedule up here first, so a
# band region that measured `sequential` takes the same path as `sequential` itself (resolving the
# placeholder on every call costs host time: docs/gpu-schedules.md#host-cost).
_DECIDED: dict[str, str] = {}


# The tuner answers an `autotune` placeholder's first call.  It registers itself here
# (tuner/matmul/autotune.py, on import) so that the runtime never imports the tuner.
_FIRST_CALL_TUNER: Callable[[Schedule, Callable, torch.device], tuple[str, bool]] | None = None


def register_first_call_tuner(tuner: Callable[[Schedule, Callable, torch.device], tuple[str, bool]]) -> None:
    """`tuner(placeholder, run, device) -> (schedule string, final)`: what an `autotune`
    placeholder runs at this call, and whether that is its decided winner."""
    global _FIRST_CALL_TUNER
    _FIRST_CALL_TUNER = tuner


def _first_call_tune(sched: Schedule, run, device: torch.device) -> tuple[str, bool]:
    if _FIRST_CALL_TUNER is None:  # only a graph compiled elsewhere carries a placeholder then
        _warn_once("autotune", f"schedule {sched}: no tuner in this process; running sequential")
        return "sequential", False
    return _FIRST_CALL_TUNER(sched, run, device)


def resolve(op: str, schedule: str, device: torch.device, why_not, run=None, shapes=None) -> Schedule:
    """The schedule this call runs.  `autotune` placeholders become the measured winner
    (timed now, at the region's first call, with `run(schedule)`); `auto` becomes the rule's
    pick for this call's shapes (`shapes()`: kernels.auto.auto_schedule's arguments after the
    schedule; a region compiled with dynamic shapes).  A GPU schedule runs on
    CUDA tensors when the call fits it (`why_not(sched, capturing)` returns None; inside a
    CUDA-graph capture a schedule also needs its symmetric buffer to exist already, and the
    fused reductions are refused); on other devices its reference twin runs (the same
    pieces in plain torch + c10d); a CUDA call that does not fit runs `sequential`, logged
    once per reason."""
    sched = _parse(schedule)
    if not sched.valid_for(op):
        raise ValueError(f"commopt {op}: no schedule {sched.name!r} for this op")
    if sched.name == "autotune":
        picked, is_final = _first_call_tune(sched, run, device)
        if sched.param("cg") and _parse(picked).is_gpu:  # the region replays per-call graphs
            picked = str(_parse(picked).with_params(cg=1))
        if is_final:
            _DECIDED[schedule] = picked
        sched = _parse(picked)
    elif sched.name == "auto":
        from torch_commopt.kernels.matmul.auto import auto_schedule

        sched = _parse(auto_schedule(op, schedule, *shapes()))
    if not sched.is_gpu:
        return sched
    if device.type != "cuda":
        return sched.reference_twin()
    in_capture = capturing()
    reason = why_not(sched, in_capture)
    if reason is None:
        return sched
    alt = sched.in_capture(op) if in_capture else sched
    if alt != sched:
        # Capturable with the same pieces; falling back to NCCL here could instead hit a
        # communicator's first use, which NCCL cannot do inside a capture.
        if why_not(alt, True) is None:
            _warn_once(op, f"schedule {sched} inside a CUDA-graph capture runs {alt} (capturable, same pieces)")
            return alt
    _warn_once(op, f"schedule {sched} refused ({reason}); running sequential")
    return Schedule("sequential")


def _on_gpu(op: str, sched: Schedule, call):
    """call()'s result (a GPU schedule's), or None where its symmetric memory could not be
    allocated on every rank of the group: then every rank gets None at this call, before
    anything moved (kernels.gpu.symm.SymmAllocError), and runs sequential instead, logged."""
    from torch_commopt.kernels.gpu.symm import SymmAllocError

    try:
        return call()
    except SymmAllocError as e:
        _warn_once(op, f"schedule {sched}: {e}; running sequential")
        return None


def _shapes(a: Tensor, weights: list[Tensor], dim: int | None, group_size: int) -> tuple:
    """What an `auto` call's choice depends on (kernels.auto.auto_schedule's arguments)."""
    return (tuple(a.shape), tuple(tuple(w.shape) for w in weights), dim, group_size,
            str(a.dtype).removeprefix("torch."), a.device.type)


def _warn_once(op: str, message: str) -> None:
    if (op, message) not in _warned:
        _warned.add((op, message))
        log.warning("commopt %s: %s", op, message)


def gathered_shape(a: Tensor, gather_dim: int, group_size: int) -> list[int]:
    shape = list(a.shape)
    shape[gather_dim] *= group_size
    return shape


@_op("ag_matmul")
def ag_matmul(
    a: Tensor,
    weights: list[Tensor],
    biases: list[Optional[Tensor]],
    gather_dim: int,
    group_size: int,
    group_name: str,
    schedule: str,
    return_gathered: bool,
    a_scale: Optional[Tensor] = None,
    b_scales: Optional[list[Tensor]] = None,
    out_dtype: Optional[torch.dtype] = None,
    fast_accum: bool = False,
) -> list[Tensor]:
    """All-gather `a` along `gather_dim`, then multiply by each weight.

    a: (*, L, *, K) local shard, L at `gather_dim` (or K itself when gather_dim is last).
    weights[i]: (K_full, N_i), or (B, K_full, N_i) with a 3-D gathered a (bmm).
    biases[i]: (N_i,) or None.
    Returns [out_0, ..., out_{n-1}] (+ [gathered] when return_gathered), where
    gathered = cat over ranks of a along gather_dim and out_i = gathered @ weights[i] + biases[i].
    a_scale, b_scales, out_dtype, fast_accum: the products are torch._scaled_mm's (float8
    a and weights, tensor-wise scales; kernels/scaled.py), in out_dtype.
    """
    sc = scaled.of(a, a_scale, b_scales, out_dtype, fast_accum, len(weights))
    schedule = _DECIDED.get(schedule, schedule)  # an autotune placeholder that has decided
    if schedule == "sequential" and sequential.applies(a, weights, gather_dim, group_size, cut=False):
        return sequential.ag_matmul(a, weights, biases, group_name, return_gathered, sc, gather_dim)
    def why_not(sched, in_capture):
        from torch_commopt.kernels.matmul.gpu.ag_matmul import unsupported_reason

        return unsupported_reason(a, weights, gather_dim, sched, group_name, group_size, in_capture, sc)

    def run(s):
        return ag_matmul(a, weights, biases, gather_dim, group_size, group_name, s, return_gathered,
                         a_scale, b_scales, out_dtype, fast_accum)

    sched = resolve("ag_matmul", schedule, a.device, why_not, run, lambda: _shapes(a, weights, gather_dim, group_size))
    if sched.is_gpu:
        from torch_commopt.kernels.matmul.gpu.ag_matmul import ag_matmul_gpu

        out = _on_gpu("ag_matmul", sched, lambda: ag_matmul_gpu(a, weights, biases, gather_dim, group_name, sched,
                                                                 return_gathered, sc))
        if out is not None:
            return out
        sched = Schedule("sequential")
    if sched.name == "sequential" and sequential.applies(a, weights, gather_dim, group_size, cut=False):
        return sequential.ag_matmul(a, weights, biases, group_name, return_gathered, sc,
                                    gather_dim)  # e.g. autotune's winner
    return ag_matmul_reference(a, weights, biases, gather_dim, group_name, str(sched), return_gathered, sc)


@torch.library.register_fake("commopt::ag_matmul")
def _(a, weights, biases, gather_dim, group_size, group_name, schedule, return_gathered, a_scale=None, b_scales=None,
      out_dtype=None, fast_accum=False):
    gshape = gathered_shape(a, gather_dim, group_size)
    dtype = a.dtype if a_scale is None else out_dtype
    outs = [a.new_empty(gshape[:-1] + [w.shape[-1]], dtype=dtype) for w in weights]
    return outs + ([a.new_empty(gshape)] if return_gathered else [])


@_op("matmul_rs")
def matmul_rs(
    a: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scatter_dim: int,
    reduce_op: str,
    group_size: int,
    group_name: str,
    schedule: str,
    a_scale: Optional[Tensor] = None,
    b_scale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    fast_accum: bool = False,
    more_a: Optional[list[Tensor]] = None,
    more_w: Optional[list[Tensor]] = None,
) -> Tensor:
    """t = a @ weight (+ bias), then reduce-scatter t along `scatter_dim`.

    a: (*, K); weight: (K, N); bias: (N,) or None.
    Returns t's shape with dim `scatter_dim` divided by group_size: block `rank`,
    reduced over ranks with `reduce_op` ("sum" or "avg").
    a_scale, b_scale, out_dtype, fast_accum: t is torch._scaled_mm's (kernels/scaled.py).
    more_a, more_w: K parts, t = a @ weight + sum_i more_a[i] @ more_w[i] (+ bias), more_a[i]
    (*, K_i) and more_w[i] (K_i, N): a sum of matmuls reduced as one, without concatenating
    the operands (passes/matmul/concat_k.py); `fused` alone multiplies them concatenated.
    """
    sc = scaled.of(a, a_scale, None if b_scale is None else [b_scale], out_dtype, fast_accum, 1)
    parts = k_parts(a, weight, more_a, more_w, sc is not None)
    schedule = _DECIDED.get(schedule, schedule)  # an autotune placeholder that has decided
    if schedule == "sequential" and sequential.applies(a, [weight], scatter_dim, group_size, cut=True):
        return sequential.matmul_rs(a, weight, bias, reduce_op, group_name, sc, parts, scatter_dim)  # split: checked
    _check_scatter(a, weight, scatter_dim, group_size)

    def why_not(sched, in_capture):
        from torch_commopt.kernels.matmul.gpu.matmul_reduce import unsupported_reason

        return unsupported_reason(a, weight, scatter_dim, group_size, sched, group_name, in_capture, sc)

    def run(s):
        return matmul_rs(a, weight, bias, scatter_dim, reduce_op, group_size, group_name, s,
                         a_scale, b_scale, out_dtype, fast_accum, more_a, more_w)

    sched = resolve("matmul_rs", schedule, a.device, why_not, run, lambda: _shapes(a, [weight], scatter_dim, group_size))
    if sched.is_gpu:
        from torch_commopt.kernels.matmul.gpu.matmul_reduce import matmul_rs_gpu

        out = _on_gpu("matmul_rs", sched, lambda: matmul_rs_gpu(Product(a, weight, bias, sc, parts), scatter_dim,
                                                                reduce_op, group_name, sched))
        if out is not None:
            return out
        sched = Schedule("sequential")
    if sched.name == "sequential" and sequential.applies(a, [weight], scatter_dim, group_size, cut=True):
        return sequential.matmul_rs(a, weight, bias, reduce_op, group_name, sc, parts,
                                    scatter_dim)  # e.g. autotune's winner
    return matmul_rs_reference(Product(a, weight, bias, sc, parts), scatter_dim, reduce_op, group_name, str(sched))


def k_parts(a: Tensor, weight: Tensor, more_a, more_w, scaled_product: bool) -> tuple[tuple[Tensor, Tensor], ...]:
    """The K parts beyond (a, weight) as ((a_i, w_i), ...); ValueError naming what does not fit."""
    more_a, more_w = list(more_a or ()), list(more_w or ())
    if len(more_a) != len(more_w):
        raise ValueError(f"commopt: {len(more_a)} more_a for {len(more_w)} more_w (K parts come in pairs)")
    if more_a and scaled_product:
        raise ValueError("commopt: K parts (more_a / more_w) with a scaled (float8) product are not supported")
    for i, (x, w) in enumerate(zip(more_a, more_w)):
        fits = tuple(x.shape[:-1]) == tuple(a.shape[:-1]) and tuple(w.shape) == (x.shape[-1], weight.shape[-1])
        if not fits:
            raise ValueError(f"commopt: K part {i}: more_a {tuple(x.shape)} @ more_w {tuple(w.shape)} does not match "
                             f"a {tuple(a.shape)} @ weight {tuple(weight.shape)} (same rows, same N)")
        if x.dtype != a.dtype or w.dtype != weight.dtype or x.device != a.device or w.device != a.device:
            raise ValueError(f"commopt: K part {i}: dtypes / devices differ from a's and weight's")
    return tuple(zip(more_a, more_w))


def _check_scatter(a: Tensor, weight: Tensor, scatter_dim: int, group_size: int) -> None:
    """A reduce-scatter gives every rank an equal block of the product: refuse a dim that does not split."""
    shape = list(a.shape[:-1]) + [weight.shape[-1]]
    if not 0 <= scatter_dim < len(shape):
        raise ValueError(f"commopt matmul_rs: scatter_dim {scatter_dim} outside the product's {len(shape)} dims")
    if shape[scatter_dim] % group_size:
        raise ValueError(f"commopt matmul_rs: dim {scatter_dim} of the product {tuple(shape)} does not split into "
                         f"{group_size} equal blocks (a reduce-scatter needs it)")


@torch.library.register_fake("commopt::matmul_rs")
def _(a, weight, bias, scatter_dim, reduce_op, group_size, group_name, schedule, a_scale=None, b_scale=None,
      out_dtype=None, fast_accum=False, more_a=None, more_w=None):
    k_parts(a, weight, more_a, more_w, a_scale is not None)
    _check_scatter(a, weight, scatter_dim, group_size)
    shape = list(a.shape[:-1]) + [weight.shape[-1]]
    shape[scatter_dim] //= group_size
    return a.new_empty(shape, dtype=a.dtype if a_scale is None else out_dtype)


@_op("matmul_ar")
def matmul_ar(
    a: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    reduce_op: str,
    group_size: int,
    group_name: str,
    schedule: str,
    a_scale: Optional[Tensor] = None,
    b_scale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    fast_accum: bool = False,
    more_a: Optional[list[Tensor]] = None,
    more_w: Optional[list[Tensor]] = None,
) -> Tensor:
    """t = a @ weight (+ bias), then all-reduce t.  a: (*, K); weight: (K, N); returns (*, N).
    a_scale, b_scale, out_dtype, fast_accum: t is torch._scaled_mm's (kernels/scaled.py).
    more_a, more_w: K parts, t = a @ weight + sum_i more_a[i] @ more_w[i] (as matmul_rs)."""
    sc = scaled.of(a, a_scale, None if b_scale is None else [b_scale], out_dtype, fast_accum, 1)
    parts = k_parts(a, weight, more_a, more_w, sc is not None)
    schedule = _DECIDED.get(schedule, schedule)  # an autotune placeholder that has decided
    if schedule == "sequential" and sequential.applies(a, [weight], None, group_size, cut=False):
        return sequential.matmul_ar(a, weight, bias, reduce_op, group_name, sc, parts)
    def why_not(sched, in_capture):
        from torch_commopt.kernels.matmul.gpu.matmul_reduce import unsupported_reason

        return unsupported_reason(a, weight, None, group_size, sched, group_name, in_capture, sc)

    def run(s):
        return matmul_ar(a, weight, bias, reduce_op, group_size, group_name, s, a_scale, b_scale, out_dtype, fast_accum,
                         more_a, more_w)

    sched = resolve("matmul_ar", schedule, a.device, why_not, run, lambda: _shapes(a, [weight], None, group_size))
    if sched.is_gpu:
        from torch_commopt.kernels.matmul.gpu.matmul_reduce import matmul_ar_gpu

        out = _on_gpu("matmul_ar", sched, lambda: matmul_ar_gpu(Product(a, weight, bias, sc, parts), reduce_op,
                                                                group_name, sched))
        if out is not None:
            return out
        sched = Schedule("sequential")
    if sched.name == "sequential" and sequential.applies(a, [weight], None, group_size, cut=False):
        return sequential.matmul_ar(a, weight, bias, reduce_op, group_name, sc, parts)  # e.g. autotune's winner
    return matmul_ar_reference(Product(a, weight, bias, sc, parts), reduce_op, group_name, str(sched))


@torch.library.register_fake("commopt::matmul_ar")
def _(a, weight, bias, reduce_op, group_size, group_name, schedule, a_scale=None, b_scale=None, out_dtype=None,
      fast_accum=False, more_a=None, more_w=None):
    k_parts(a, weight, more_a, more_w, a_scale is not None)
    return a.new_empty(list(a.shape[:-1]) + [weight.shape[-1]], dtype=a.dtype if a_scale is None else out_dtype)


@_op("shard_rows")
def shard_rows(x: Tensor, group_size: int, group_name: str, check: bool = False, dim: int = 0) -> Tensor:
    """This rank's block of dim `dim` of `x` (which holds the same values on every rank): what
    the all-reduce split (passes/matmul/ar_split.py) gives the ops that now run on 1/W of the rows.
    check=True: first verify that `x` is the same on every rank (Config.ar_split="checked")."""
    if check:
        _check_replicated(x, group_name, "a full-shaped operand")
    rank = resolve_group(group_name).rank()
    # a new tensor, never a view: an op's output may not alias its input
    return x.chunk(group_size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)


@torch.library.register_fake("commopt::shard_rows")
def _(x, group_size, group_name, check=False, dim=0):
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


@_op("replicated")
def replicated(x: Tensor, group_size: int, group_name: str) -> Tensor:
    """`x` (a copy), after verifying that it holds the same values on every rank: the
    all-reduce split's check of a broadcast operand (Config.ar_split="checked")."""
    _check_replicated(x, group_name, "a broadcast operand")
    return x.clone()


@torch.library.register_fake("commopt::replicated")
def _(x, group_size, group_name):
    return torch.empty_like(x)


class NotReplicated(RuntimeError):
    """An operand the all-reduce split assumed equal on every rank differs between ranks."""


def _check_replicated(x: Tensor, group_name: str, what: str) -> None:
    """Compare a checksum of `x` across the group (one small all-gather); raise where it differs."""
    group = resolve_group(group_name)
    xd = x.detach().double()
    mine = torch.stack([xd.sum(), xd.abs().sum(), (xd * torch.arange(1, xd.numel() + 1, dtype=torch.float64,
                                                                       device=x.device).view(xd.shape)).sum()])
    every = torch.empty(group.size() * 3, dtype=torch.float64, device=x.device)
    dist.all_gather_into_tensor(every, mine, group=group)
    every = every.view(group.size(), 3)
    if not bool((every == every[0]).all()):
        raise NotReplicated(
            f"commopt ar_split: {what} of shape {list(x.shape)} differs between the ranks of group {group_name} "
            f"(checksums {every.tolist()}); the all-reduce split assumes it is replicated -- turn Config.ar_split off "
            "for this program")


def runner(kind: str, a: Tensor, weights: list[Tensor], world: int, group_name: str):
    """fn(schedule) calling op `kind` on `a` with `weights` (no bias; collective dim 0, sum):
    how calibration probes and the tune CLI time a region shape."""
    ops = torch.ops.commopt
    if kind == "ag_matmul":
        return lambda s: ops.ag_matmul(a, weights, [None] * len(weights), 0, world, group_name, s, False)
    if kind == "matmul_rs":
        return lambda s: ops.matmul_rs(a, weights[0], None, 0, "sum", world, group_name, s)
    return lambda s: ops.matmul_ar(a, weights[0], None, "sum", world, group_name, s)
