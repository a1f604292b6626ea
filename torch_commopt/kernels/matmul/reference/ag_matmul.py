"""Reference schedules of all-gather + matmul.

Semantics (every schedule): gathered = concat over ranks of `a` along `gather_dim`;
out_i = gathered @ weights[i] (+ biases[i]) over the last dim of gathered.
"""

from __future__ import annotations

import torch

from torch_commopt.core.groups import resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.collectives import all_gather, chunk_bounds, linear, merge_rank_dim
from torch_commopt.kernels.matmul.reference.chunking import ag_chunk_dim
from torch_commopt.kernels.scaled import matmul, out_dtype


def ag_matmul_sequential(a, weights, biases, gather_dim, group, return_gathered, sc=None):
    gathered = all_gather(a, gather_dim, group, async_op=False).wait()
    outs = [linear(gathered, w, b, sc, i) for i, (w, b) in enumerate(zip(weights, biases))]
    return outs + ([gathered] if return_gathered else [])


def ag_matmul_chunked(a, weights, biases, gather_dim, group, return_gathered, chunks, sc=None):
    world, shape = group.size(), list(a.shape)
    g, (c, _) = gather_dim, ag_chunk_dim(shape, gather_dim, chunks)
    gshape = shape[:g] + [world * shape[g]] + shape[g + 1 :]
    outs = [a.new_empty(gshape[:-1] + [w.shape[-1]], dtype=out_dtype(a, sc)) for w in weights]
    gathered = a.new_empty(gshape) if return_gathered else None
    bounds = chunk_bounds(shape[c], chunks)
    # Issue every piece first: piece j+1 travels while piece j is multiplied.
    pending = [all_gather(a.narrow(c, s, n), g, group, async_op=True) for s, n in bounds]
    for (s, n), piece in zip(bounds, pending):
        rows = piece.wait()
        for i, (out, w, b) in enumerate(zip(outs, weights, biases)):
            _place(out, linear(rows, _weight_piece(w, g, c, s, n, world, shape), b, sc, i), g, c, s, n, world, shape)
        if gathered is not None:
            _place(gathered, rows, g, c, s, n, world, shape)
    return outs + ([gathered] if return_gathered else [])


def ag_matmul_local_first(a, weights, biases, gather_dim, group, return_gathered, sc=None):
    """Gather asynchronously; multiply the own shard meanwhile, then the peers' rows.

    The gather lands rank-major in a flat (W * d0, ...) buffer, so the peers before and
    after this rank are two contiguous row ranges: at most two more GEMMs per weight,
    written straight into a rank-major output (a view of the result when gather_dim is 0,
    one copy otherwise).  A gather along the contracted dim sums instead: `_local_first_k`.
    Batched (3-D) weights follow the gathered batch rows: they run `sequential`."""
    if any(w.dim() != 2 for w in weights):
        return ag_matmul_sequential(a, weights, biases, gather_dim, group, return_gathered, sc)
    if gather_dim == a.dim() - 1:
        return _local_first_k(a, weights, biases, group, return_gathered, sc)
    world, rank = group.size(), group.rank()
    a = a.contiguous()
    pending = all_gather(a, gather_dim, group, async_op=True)
    rows, k = a.numel() // a.shape[-1], a.shape[-1]
    blocks = [a.new_empty((world,) + tuple(a.shape[:-1]) + (w.shape[-1],), dtype=out_dtype(a, sc)) for w in weights]
    own = a.view(rows, k)
    for i, (blk, w, b) in enumerate(zip(blocks, weights, biases)):
        matmul(own, w, b, sc, i, out=blk[rank].view(rows, -1))
    if pending.work is not None:
        pending.work.wait()
    src = pending.buffer.view(world * rows, k)
    for lo, hi in ((0, rank), (rank + 1, world)):
        if hi > lo:
            for i, (blk, w, b) in enumerate(zip(blocks, weights, biases)):
                matmul(src[lo * rows: hi * rows], w, b, sc, i, out=blk[lo:hi].view((hi - lo) * rows, -1))
    outs = [merge_rank_dim(blk, gather_dim) for blk in blocks]
    return outs + ([pending.finish(pending.buffer)] if return_gathered else [])


def _local_first_k(a, weights, biases, group, return_gathered, sc=None):
    """local_first for a gather along the contracted dim (the backward's dW = dY^T X with dY's
    tokens gathered): the product is a sum over the ranks' pieces, A_r @ W[rows of r], so this
    rank's term (and the bias) is computed while the gather travels and every peer's is added to
    it once it has landed -- two GEMMs over two ranks, their sum in the second's accumulator (one
    more rounding than a single GEMM: the output is the dtype's).  Scaled (float8) products, whose
    scales apply to the whole sum, run `sequential`."""
    if sc is not None:
        return ag_matmul_sequential(a, weights, biases, a.dim() - 1, group, return_gathered, sc)
    world, rank = group.size(), group.rank()
    a = a.contiguous()
    k = a.shape[-1]
    pending = all_gather(a, a.dim() - 1, group, async_op=True)
    own = a.reshape(-1, k)
    outs = [matmul(own, w[rank * k: (rank + 1) * k], b) for w, b in zip(weights, biases)]
    if pending.work is not None:
        pending.work.wait()
    pieces = pending.buffer.view(world, -1, k)  # rank-major: rank r's piece of A, as it came
    for r in range(world):
        if r != rank:
            for out, w in zip(outs, weights):
                out.addmm_(pieces[r], w[r * k: (r + 1) * k])
    outs = [out.view(*a.shape[:-1], out.shape[-1]) for out in outs]
    return outs + ([pending.finish(pending.buffer)] if return_gathered else [])


def _rank_blocked(x: torch.Tensor, g: int, world: int, local: int) -> torch.Tensor:
    """View dim g (world*local) of x as (world, local)."""
    shape = list(x.shape)
    return x.view(shape[:g] + [world, local] + shape[g + 1 :])


def _place(out, piece, g, c, s, n, world, shape):
    """Copy the rows of chunk (s, n) of dim c, gathered along g, into `out`."""
    if c == g:
        _rank_blocked(out, g, world, shape[g]).narrow(g + 1, s, n).copy_(_rank_blocked(piece, g, world, n))
    else:
        out.narrow(c, s, n).copy_(piece)


def _weight_piece(w, g, c, s, n, world, shape):
    """A batched (3-D) weight follows the gathered batch rows of the chunk; a 2-D one is shared."""
    if w.dim() != 3 or c != 0:
        return w
    if g == 0:
        return _rank_blocked(w, 0, world, shape[0]).narrow(1, s, n).reshape(world * n, *w.shape[1:])
    return w.narrow(0, s, n)


def ag_matmul_reference(a, weights, biases, gather_dim, group_name, schedule, return_gathered, sc=None):
    """sc: the products are scaled (fp8, kernels/scaled.py)."""
    group = resolve_group(group_name)
    sched = Schedule.parse(schedule)
    if sched.name == "local_first":
        return ag_matmul_local_first(a, weights, biases, gather_dim, group, return_gathered, sc)
    if sched.name == "sequential" or sched.chunks == 1:
        return ag_matmul_sequential(a, weights, biases, gather_dim, group, return_gathered, sc)
    return ag_matmul_chunked(a, weights, biases, gather_dim, group, return_gathered, sched.chunks, sc)
