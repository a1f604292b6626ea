"""Reference schedules of matmul + reduce-scatter and matmul + all-reduce.

Semantics: t = a @ weight (+ bias) over the last dim of `a` (plus each K part's product,
a_i @ w_i); then
matmul_rs: reduce-scatter t along `scatter_dim` (rank r keeps block r);
matmul_ar: all-reduce t (gather_sum and scatter_gather: summed in fp32 in rank order, every
rank with the same bits, as the low-latency one-shot and two-shot all-reduces sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_commopt.core.groups import resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.collectives import all_gather, all_reduce, chunk_bounds, linear, reduce_scatter
from torch_commopt.kernels.matmul.product import Product
from torch_commopt.kernels.matmul.reference.chunking import ar_chunk_dim, rs_chunk_dim
from torch_commopt.kernels.scaled import out_dtype, wire


def _product(prod: Product, piece=lambda x: x):
    """piece(a) @ weight (+ bias), plus piece(a_i) @ w_i for each K part (ops.k_parts)."""
    t = linear(piece(prod.a), prod.weight, prod.bias, prod.sc)
    for x, w in prod.parts:
        t = t + linear(piece(x), w, None, None)
    return t


def matmul_rs_reference(prod: Product, scatter_dim, reduce_op, group_name, schedule):
    """The product (scaled or with K parts as `prod` says) reduce-scattered along scatter_dim."""
    a, weight, sc = prod.a, prod.weight, prod.sc
    group = resolve_group(group_name)
    sched = Schedule.parse(schedule)
    if sched.name == "sequential" or sched.chunks == 1:
        t = _product(prod)
        return reduce_scatter(t, scatter_dim, reduce_op, group, async_op=False).wait()
    world, d = group.size(), scatter_dim
    shape = list(a.shape)
    c, _ = rs_chunk_dim(shape[:-1] + [weight.shape[-1]], d, world, sched.chunks)
    out_shape = shape[:-1] + [weight.shape[-1]]
    out_shape[d] //= world
    out = a.new_empty(out_shape, dtype=out_dtype(a, sc))
    if c == d:
        bounds = chunk_bounds(shape[d] // world, sched.chunks)

        def piece_of(s, n):
            return lambda x: x.reshape(shape[:d] + [world, shape[d] // world] + list(x.shape[d + 1:])).narrow(
                d + 1, s, n).flatten(d, d + 1)
    else:
        bounds = chunk_bounds(shape[c], sched.chunks)

        def piece_of(s, n):
            return lambda x: x.narrow(c, s, n)
    # Compute piece j, then let its reduction travel while piece j+1 is computed.
    pending = [reduce_scatter(_product(prod, piece_of(s, n)), d, reduce_op, group, async_op=True)
               for s, n in bounds]
    for (s, n), p in zip(bounds, pending):
        out.narrow(c, s, n).copy_(p.wait())
    return out


def _rank_order_sum(pieces: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """(W, ...) pieces summed in fp32 in rank order 0..W-1 (avg: divided by W), cast once."""
    acc = pieces[0].float()
    for r in range(1, pieces.shape[0]):
        acc = acc + pieces[r].float()
    if reduce_op == "avg":
        acc = acc / pieces.shape[0]
    return acc.to(pieces.dtype)


def gather_sum(t: torch.Tensor, reduce_op: str, group) -> torch.Tensor:
    """All-reduce of t as the one-shot all-reduce computes it: every rank's t gathered, summed in
    fp32 in rank order (Schedule gather_sum)."""
    world = group.size()
    flat = t.contiguous().reshape(1, -1)
    gathered = all_gather(flat, 0, group, async_op=False).wait()  # (W, numel), rank-major
    return _rank_order_sum(gathered.view(world, -1), reduce_op).view(t.shape)


def scatter_gather(t: torch.Tensor, reduce_op: str, group) -> torch.Tensor:
    """All-reduce of t as the two-shot all-reduce computes it: W element segments (the last
    padded), rank r sums segment r of every rank in fp32 in rank order, the sums all-gathered
    (Schedule scatter_gather)."""
    world = group.size()
    flat = t.contiguous().reshape(-1)
    seg = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(seg * world - flat.numel())]).view(world, seg)
    mine = torch.empty_like(padded)  # [p]: segment `rank` of rank p's t
    dist.all_to_all_single(wire(mine), wire(padded), group=group)
    summed = _rank_order_sum(mine, reduce_op).reshape(1, seg)
    whole = all_gather(summed, 0, group, async_op=False).wait().reshape(-1)
    return whole[: flat.numel()].view(t.shape)


def matmul_ar_reference(prod: Product, reduce_op, group_name, schedule):
    """The product (as `prod` says) all-reduced."""
    group = resolve_group(group_name)
    sched = Schedule.parse(schedule)
    if sched.name in ("gather_sum", "scatter_gather"):
        return (gather_sum if sched.name == "gather_sum" else scatter_gather)(_product(prod), reduce_op, group)
    if sched.name == "sequential" or sched.chunks == 1:
        return all_reduce(_product(prod), reduce_op, group, async_op=False).wait()
    a = prod.a
    out = a.new_empty(list(a.shape[:-1]) + [prod.weight.shape[-1]], dtype=out_dtype(a, prod.sc))
    c, rows = ar_chunk_dim(list(out.shape), sched.chunks)
    bounds = chunk_bounds(rows, sched.chunks)
    pending = [all_reduce(_product(prod, lambda x, s=s, n=n: x.narrow(c, s, n)), reduce_op, group, async_op=True)
               for s, n in bounds]
    for (s, n), p in zip(bounds, pending):
        out.narrow(c, s, n).copy_(p.wait())
    return out
