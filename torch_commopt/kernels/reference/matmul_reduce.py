"""Reference schedules of matmul + reduce-scatter and matmul + all-reduce.

Semantics: t = a @ weight (+ bias) over the last dim of `a`; then
matmul_rs: reduce-scatter t along `scatter_dim` (rank r keeps block r);
matmul_ar: all-reduce t.
"""

from __future__ import annotations

from torch_commopt.kernels.reference.collectives import (
    all_reduce,
    chunk_bounds,
    linear,
    reduce_scatter,
    resolve_group,
)
from torch_commopt.kernels.reference.chunking import ar_chunk_dim, rs_chunk_dim
from torch_commopt.kernels.scaled import out_dtype
from torch_commopt.schedule import Schedule


def matmul_rs_reference(a, weight, bias, scatter_dim, reduce_op, group_name, schedule, sc=None):
    """sc: the product is scaled (fp8, kernels/scaled.py)."""
    group = resolve_group(group_name)
    sched = Schedule.parse(schedule)
    if sched.name == "sequential" or sched.chunks == 1:
        return reduce_scatter(linear(a, weight, bias, sc), scatter_dim, reduce_op, group, async_op=False).wait()
    world, d = group.size(), scatter_dim
    shape = list(a.shape)
    c, _ = rs_chunk_dim(shape[:-1] + [weight.shape[-1]], d, world, sched.chunks)
    out_shape = shape[:-1] + [weight.shape[-1]]
    out_shape[d] //= world
    out = a.new_empty(out_shape, dtype=out_dtype(a, sc))
    if c == d:
        blocked = a.view(shape[:d] + [world, shape[d] // world] + shape[d + 1 :])
        bounds = chunk_bounds(shape[d] // world, sched.chunks)
        pieces = [blocked.narrow(d + 1, s, n).flatten(d, d + 1) for s, n in bounds]
    else:
        bounds = chunk_bounds(shape[c], sched.chunks)
        pieces = [a.narrow(c, s, n) for s, n in bounds]
    # Compute piece j, then let its reduction travel while piece j+1 is computed.
    pending = [reduce_scatter(linear(p, weight, bias, sc), d, reduce_op, group, async_op=True) for p in pieces]
    for (s, n), p in zip(bounds, pending):
        out.narrow(c, s, n).copy_(p.wait())
    return out


def matmul_ar_reference(a, weight, bias, reduce_op, group_name, schedule, sc=None):
    group = resolve_group(group_name)
    sched = Schedule.parse(schedule)
    if sched.name == "sequential" or sched.chunks == 1:
        return all_reduce(linear(a, weight, bias, sc), reduce_op, group, async_op=False).wait()
    out = a.new_empty(list(a.shape[:-1]) + [weight.shape[-1]], dtype=out_dtype(a, sc))
    c, rows = ar_chunk_dim(list(out.shape), sched.chunks)
    bounds = chunk_bounds(rows, sched.chunks)
    pending = [all_reduce(linear(a.narrow(c, s, n), weight, bias, sc), reduce_op, group, async_op=True)
               for s, n in bounds]
    for (s, n), p in zip(bounds, pending):
        out.narrow(c, s, n).copy_(p.wait())
    return out
