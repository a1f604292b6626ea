"""c10d helpers shared by the reference schedules (any backend: gloo, NCCL, fake).

The functional collectives in a graph name their group by a string; the reference
implementations resolve it once per call and talk to c10d directly, so that each
piece of a chunked schedule can be issued asynchronously and waited on just before
it is consumed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torch_commopt.kernels.scaled import Scaled, matmul, wire

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM}
# torch 2.13 renamed the tensor forms (the old names warn); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def chunk_bounds(size: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of `chunks` near-equal pieces of a dimension of `size` (no empty piece)."""
    chunks = max(1, min(chunks, size))
    base, extra = divmod(size, chunks)
    bounds, start = [], 0
    for j in range(chunks):
        length = base + (1 if j < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


def merge_rank_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(W, *shape) rank-major pieces -> the tensor concatenated along `dim` of shape."""
    w = x.shape[0]
    moved = x.movedim(0, dim)
    shape = list(moved.shape)
    return moved.reshape(shape[:dim] + [w * shape[dim + 1]] + shape[dim + 2 :])


def split_rank_dim(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """Inverse of merge_rank_dim: a contiguous (W, ...) tensor whose piece r is block r of `dim`."""
    shape = list(x.shape)
    x = x.reshape(shape[:dim] + [world, shape[dim] // world] + shape[dim + 1 :])
    return x.movedim(dim, 0).contiguous()


@dataclass
class Pending:
    """An issued collective: its work handle, and how to turn its buffer into the result."""

    work: dist.Work | None
    buffer: torch.Tensor
    finish: Callable[[torch.Tensor], torch.Tensor]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish(self.buffer)


def staged(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether a collective of `t` over `group` goes through host memory: a CUDA tensor over gloo,
    as where ranks share one GPU (kernels/gpu/shared_device.py: correctness runs only).  gloo's
    CUDA support does not cover every collective these kernels issue (point to point and
    all-to-all not at all; DTensor's all-gather of CUDA tensors crashed every rank on an H200
    host, docs/meshslice.md), so none is left to it.  Such a collective completes before it
    returns."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _on_host(out: torch.Tensor, x: torch.Tensor, collective: Callable) -> None:
    """out <- collective(host out, host x), completed (`staged`)."""
    host = torch.empty(out.shape, dtype=out.dtype)
    collective(host, x.cpu())
    out.copy_(host)


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, async_op: bool) -> Pending:
    """All-gather `x` along `dim` (rank-major pieces merged into `dim` on wait)."""
    world = group.size()
    x = x.contiguous()
    # The flat (W*d0, ...) buffer is what every backend (the fake one too) expects.
    buf = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))

    def merge(b: torch.Tensor) -> torch.Tensor:
        return merge_rank_dim(b.view((world,) + tuple(x.shape)), dim)

    if staged(x, group):
        _on_host(buf, x, lambda out, src: _all_gather_single(wire(out), wire(src), group=group))
        return Pending(None, buf, merge)
    work = _all_gather_single(wire(buf), wire(x), group=group, async_op=async_op)
    return Pending(work if async_op else None, buf, merge)


def reduce_scatter(x: torch.Tensor, dim: int, op: str, group: dist.ProcessGroup, *, async_op: bool) -> Pending:
    """Reduce-scatter `x` along `dim`: rank r gets block r of `dim`, reduced over ranks."""
    world = group.size()
    rank_major = split_rank_dim(x, dim, world)
    buf = x.new_empty(rank_major.shape[1:])
    # "avg" runs as a sum and a division: gloo has no AVG reduction.
    finish = (lambda b: b.div_(world)) if op == "avg" else (lambda b: b)
    if staged(x, group):
        _on_host(buf, rank_major.flatten(0, 1),
                 lambda out, src: _reduce_scatter_single(out, src, op=_REDUCE_OPS[op], group=group))
        return Pending(None, buf, finish)
    work = _reduce_scatter_single(buf, rank_major.flatten(0, 1), op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return Pending(work if async_op else None, buf, finish)


def all_reduce(x: torch.Tensor, op: str, group: dist.ProcessGroup, *, async_op: bool) -> Pending:
    world = group.size()
    buf = x.contiguous()
    finish = (lambda b: b.div_(world)) if op == "avg" else (lambda b: b)
    if staged(buf, group):
        host = buf.cpu()
        dist.all_reduce(host, op=_REDUCE_OPS[op], group=group)
        buf.copy_(host)
        return Pending(None, buf, finish)
    work = dist.all_reduce(buf, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    return Pending(work if async_op else None, buf, finish)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, sc: Scaled | None = None, i: int = 0) -> torch.Tensor:
    """x @ w (+ b) over the last dim of x, computed as one mm/addmm (or bmm for 3-D w); sc:
    the scaled (fp8) product of weight i instead (kernels/scaled.py)."""
    if w.dim() == 3:
        out = torch.bmm(x, w)
        return out if b is None else out + b
    rows = x.reshape(-1, x.shape[-1])
    return matmul(rows, w, b, sc, i).view(*x.shape[:-1], w.shape[-1])
