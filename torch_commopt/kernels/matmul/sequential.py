"""`sequential` (collective, then GEMM) with the least host work per call.

The schedule is the NCCL + cuBLAS baseline itself; on a short GEMM its cost is host time.
The `torch.distributed` wrappers (`all_gather_into_tensor`, ...) check their arguments,
resolve the group and build an options object on every call; here the process group's
own methods are called with options built once, and the general reference path's
layout shuffles are skipped.  Covered: the collective along any dim but the last of a
contiguous input (what TP/SP regions use); along dim d > 0 -- a sequence-parallel (B, S, K)
activation -- the all-gather's rank-major result is moved into place, and the reduce-scatter's
input made rank-major, by one copy each, as Inductor's own graph does.  Anything else takes the
reference path.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions

from torch_commopt.core.groups import resolve_group
from torch_commopt.kernels.collectives import merge_rank_dim, split_rank_dim
from torch_commopt.kernels.scaled import Scaled, matmul, wire


@functools.cache
def _options():
    """All-gather / reduce-scatter / all-reduce options (sum, blocking), built once."""
    ag, rs, ar = AllgatherOptions(), ReduceScatterOptions(), AllreduceOptions()
    rs.reduceOp = ar.reduceOp = dist.ReduceOp.SUM
    for opts in (ag, rs, ar):
        if hasattr(opts, "asyncOp"):  # torch >= 2.7: a blocking collective runs on the current stream
            opts.asyncOp = False
    return ag, rs, ar


def applies(a: torch.Tensor, weights: list[torch.Tensor], dim: int | None, world: int, *, cut: bool) -> bool:
    """Whether the lean path covers this call: the collective along a dim before the last (None:
    an all-reduce) of a contiguous input, 2-D weights, and (cut=True: reduce-scatter) a dim that
    splits evenly."""
    if a.dim() < 2 or not a.is_contiguous() or any(w.dim() != 2 for w in weights):
        return False
    if dim is None:
        return True
    dim = dim % a.dim()
    return dim < a.dim() - 1 and (not cut or a.shape[dim] % world == 0)


def _wait(work) -> None:
    """A blocking NCCL collective (asyncOp=False) ran on the current stream and returns no
    work object; gloo returns one to wait on."""
    if work is not None:
        work.wait()


def _linear(x: torch.Tensor, w: torch.Tensor, b, sc: Scaled | None = None, i: int = 0) -> torch.Tensor:
    rows = x.view(-1, x.shape[-1])
    return matmul(rows, w, b, sc, i).view(*x.shape[:-1], w.shape[-1])


def ag_matmul(a, weights, biases, group_name: str, return_gathered: bool, sc: Scaled | None = None,
              dim: int = 0) -> list[torch.Tensor]:
    group, (opts, _, _) = resolve_group(group_name), _options()
    world, dim = group.size(), dim % a.dim()
    stacked = a.new_empty((world * a.shape[0],) + tuple(a.shape[1:]))  # rank-major
    _wait(group._allgather_base(wire(stacked), wire(a), opts))
    # rank r's block in place along dim (one copy)
    gathered = merge_rank_dim(stacked.view(world, *a.shape), dim) if dim else stacked
    outs = [_linear(gathered, w, b, sc, i) for i, (w, b) in enumerate(zip(weights, biases))]
    return outs + [gathered] if return_gathered else outs


def _product(a, weight, bias, sc: Scaled | None, parts) -> torch.Tensor:
    """a @ weight (+ bias), each K part's product (ops.k_parts) added in place."""
    full = _linear(a, weight, bias, sc)
    for x, w in parts:
        full.view(-1, full.shape[-1]).addmm_(x.reshape(-1, x.shape[-1]), w)
    return full


def matmul_rs(a, weight, bias, reduce_op: str, group_name: str, sc: Scaled | None = None, parts=(),
              dim: int = 0) -> torch.Tensor:
    group, (_, opts, _) = resolve_group(group_name), _options()
    world, dim = group.size(), dim % a.dim()
    full = _product(a, weight, bias, sc, parts)
    shape = list(full.shape)
    shape[dim] //= world
    if dim:  # rank-major rows, as _reduce_scatter_base takes them (one copy)
        full = split_rank_dim(full, dim, world).view(world * shape[0], *shape[1:])
    out = full.new_empty(shape)
    _wait(group._reduce_scatter_base(out, full, opts))
    return out.div_(world) if reduce_op == "avg" else out


def matmul_ar(a, weight, bias, reduce_op: str, group_name: str, sc: Scaled | None = None, parts=()) -> torch.Tensor:
    group, (_, _, opts) = resolve_group(group_name), _options()
    out = _product(a, weight, bias, sc, parts)
    _wait(group.allreduce([out], opts))
    return out.div_(group.size()) if reduce_op == "avg" else out
