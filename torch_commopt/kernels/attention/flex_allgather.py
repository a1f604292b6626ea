"""The reference all-gather schedule of FlexAttention over a sequence-sharded Q, K and V (plain torch + c10d).

Rank p holds rows and keys [p * L, (p + 1) * L).  Forward: the whole sequence's K and V are gathered
in G groups of KV heads, group g + 1's gather in flight while group g attends; each group is one
flex call of the rank's rows against every key under its rows' mask (flex.step_mask(p, None)).  That
is the program's own kernel on 1/W of the rows: no merge, and the whole mask's block sparsity kept
(an empty tile is skipped inside the kernel).  Backward: dq from each group's call, and the whole
sequence's dK/dV of the group reduce-scattered to their owners.  One head group's gathered K/V can
be kept from the forward (`allgather_forward(keep=True)`, as the program's own all-gather keeps
them: W times the rank's K/V a layer), so that its backward gathers nothing; else (and with more
groups) each group's K/V is gathered again.

Head groups need a mask that is the same for every head (its tables broadcast over heads); a
per-head mask runs in one group.  Every key is sent to every rank whatever the mask (the ring,
flex_ring.py, computes per source and is the schedule that can skip); over two ranks with
TORCH_COMMOPT_FLEX_GATHER_CUT (experimental) a one-group gather on the copy engine pulls only the
keys the rank's rows keep tiles of (_pull_spans, ce_gather.all_gather_kv_pulled), and its
reduce-scatter pushes only the gradients of those keys (ce_gather.reduce_scatter_kv_cut).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from torch_commopt.kernels.attention import ce_gather, comm, flex
from torch_commopt.kernels.attention.local import acc_dtype
from torch_commopt.kernels.collectives import all_gather, reduce_scatter


@dataclass(frozen=True)
class Options:
    """How the schedule runs: the mask's blocks, the softmax scale, the group and the head groups."""

    blocks: flex.Blocks
    scale: float
    group: object
    groups: int = 1


def _head_groups(q: Tensor, k: Tensor, opts: Options) -> list[tuple[slice, slice]]:
    """(query heads, KV heads) of each head group: opts.groups groups of whole KV heads' GQA
    families; one group where the mask differs per head or the KV heads do not split."""
    h_kv, rep = k.shape[1], q.shape[1] // k.shape[1]
    per_head = opts.blocks.kv_num.shape[1] > 1
    g = 1 if per_head or h_kv % opts.groups else opts.groups
    size = h_kv // g
    return [(slice(i * size * rep, (i + 1) * size * rep), slice(i * size, (i + 1) * size)) for i in range(g)]


def _rows_step(blocks: flex.Blocks, p: int, world: int) -> flex.Step:
    """Rank p's rows against every key, cut once for a mask's tensors (flex.cached)."""
    return flex.cached(blocks, ("allgather", p, world), lambda: flex.step_mask(blocks, p, None, world))


def _pull_spans(opts: Options, step: flex.Step, k: Tensor, heads: list) -> list | None:
    """Per source, the (start, end) tokens of its share that this rank's rows keep tiles of (None:
    none), where the one-group gather pulls cut (ce_gather.cut_agreed, two ranks, CUDA); else
    None.  From the rows' extent over every key (one host read, once for a mask's tensors): a
    superset of every key block the flex kernels read."""
    world = comm.size(opts.group)
    if world != 2 or len(heads) != 1 or not k.is_cuda or not ce_gather.cut_agreed(opts.group):
        return None
    p, length = comm.rank(opts.group), opts.blocks.share(world)

    def build():
        extent = flex.extents([step])[0]
        spans = []
        for s in range(world):
            lo = s * length if extent is None else max(extent.keys.start, s * length)
            hi = s * length if extent is None else min(extent.keys.stop, (s + 1) * length)
            spans.append((lo - s * length, hi - s * length) if lo < hi else None)
        return spans

    return flex.cached(opts.blocks, ("allgather spans", p, world), build)


def _gathers(k: Tensor, v: Tensor, heads: list[tuple[slice, slice]], group, kept: tuple[Tensor, Tensor] | None = None,
             spans: list | None = None):
    """The groups' K/V all-gathers along the sequence, each issued one group ahead of its use
    (kept: the one group's gathered K/V, from the forward: nothing gathered; spans: the one
    group's gather pulls only these keys, _pull_spans)."""
    if kept is not None:
        if len(heads) != 1:
            raise ValueError(f"flex all-gather: gathered K/V are kept for one head group, not {len(heads)}")
        yield 0, list(kept)
        return
    move = ce_gather.all_gather_kv if spans is None else functools.partial(ce_gather.all_gather_kv_pulled, spans=spans)
    moved = _by_copy_engine(move, k, v, group) if len(heads) == 1 else None
    if moved is not None:
        yield 0, list(moved)
        return
    issue = lambda kv: [all_gather(t[:, kv].contiguous(), 2, group, async_op=True) for t in (k, v)]  # noqa: E731
    pending = issue(heads[0][1])
    for i in range(len(heads)):
        nxt = issue(heads[i + 1][1]) if i + 1 < len(heads) else None
        yield i, [p.wait() for p in pending]
        pending = nxt


def _by_copy_engine(move, a: Tensor, b: Tensor, group):
    """move(a, b, group) (ce_gather's all-gather or reduce-scatter of one head group's K/V or
    their gradients) where ce_gather.usable says the copy engine moves them; None where NCCL
    does: not asked for, or a symmetric buffer refused on every rank alike (logged once)."""
    a, b = a.contiguous(), b.contiguous()  # what NCCL's path copies too, where they are not
    if not ce_gather.usable([a, b], group):
        return None
    from torch_commopt.kernels.gpu.symm import SymmAllocError

    try:
        return move(a, b, group)
    except SymmAllocError as e:  # on every rank of the group together, before anything moved
        comm.refused_once(f"commopt flex all-gather: {e}; K/V move on NCCL")
        return None


def _joined(parts: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The head groups' pieces as one tensor along the heads, in `dtype` (one group: no copy where
    it already is)."""
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).to(dtype)


def allgather_forward(q: Tensor, k: Tensor, v: Tensor, opts: Options, *,
                      keep: bool = False) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """(out, lse, kept) of this rank's rows over the whole sequence (out in q's dtype, lse in the acc
    dtype); kept: with keep, where the call ran in one head group, the gathered (K, V) for
    allgather_backward, else None."""
    world, p = comm.size(opts.group), comm.rank(opts.group)
    step = _rows_step(opts.blocks, p, world)
    heads = _head_groups(q, k, opts)
    outs, lses = [], []
    for i, (k_all, v_all) in _gathers(k, v, heads, opts.group, spans=_pull_spans(opts, step, k, heads)):
        o, l_g = flex.block_forward(q[:, heads[i][0]].contiguous(), k_all, v_all, step, opts.scale)
        outs.append(o)
        lses.append(l_g)
    kept = (k_all, v_all) if keep and len(heads) == 1 else None
    return _joined(outs, q.dtype), _joined(lses, acc_dtype(q.dtype)), kept


def _scatter_dtype(g: Tensor, world: int) -> torch.dtype:
    """The dtype dK/dV are reduce-scattered in: their own over two ranks, where the reduction is
    one sum of two values rounded once (as the acc-dtype sum rounded back is, to a last-bit tie)
    at half the bytes of bf16's acc dtype; the acc dtype over more ranks, where each hop of a ring
    would round again."""
    return g.dtype if world == 2 else acc_dtype(g.dtype)


def allgather_backward(saved: tuple[Tensor, ...], dout: Tensor, opts: Options,
                       kept: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares from saved = (q, k, v, out, lse), in the inputs' dtypes
    (kept: the forward's gathered K/V, allgather_forward(keep=True); k and v then give only their
    shapes and dtypes)."""
    q, k, v, out, lse = saved
    world, p = comm.size(opts.group), comm.rank(opts.group)
    step = _rows_step(opts.blocks, p, world)
    heads = _head_groups(q, k, opts)
    dqs, scattering = [], []
    spans = _pull_spans(opts, step, k, heads)
    scatter = ce_gather.reduce_scatter_kv if spans is None else functools.partial(
        ce_gather.reduce_scatter_kv_cut, sent=spans[1 - p])
    for i, (k_all, v_all) in _gathers(k, v, heads, opts.group, kept, None if kept is not None else spans):
        hq = heads[i][0]
        gq, gk, gv = flex.block_backward(q[:, hq].contiguous(), k_all, v_all, out[:, hq].contiguous(),
                                         lse[:, hq].contiguous(), dout[:, hq].contiguous(), step, opts.scale)
        dqs.append(gq)
        summed = _by_copy_engine(scatter, gk, gv, opts.group) if len(heads) == 1 else None
        if summed is not None:
            return _joined([gq], q.dtype), summed[0].to(k.dtype), summed[1].to(v.dtype)
        scattering.append([reduce_scatter(g.to(_scatter_dtype(g, world)), 2, "sum", opts.group, async_op=True)
                           for g in (gk, gv)])
    dk = _joined([pk.wait() for pk, _ in scattering], k.dtype)
    dv = _joined([pv.wait() for _, pv in scattering], v.dtype)
    return _joined(dqs, q.dtype), dk, dv


class FlexAllGather(torch.autograd.Function):
    """All-gather FlexAttention with autograd: forward(q, k, v, opts) -> out in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, opts):
        # one head group keeps its gathered K/V, as the program's own all-gather does
        out, lse, kept = allgather_forward(q, k, v, opts, keep=True)
        ctx.save_for_backward(q, k, v, out, lse, *(kept or ()))
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        kept = tuple(saved[5:]) or None
        dq, dk, dv = allgather_backward(saved[:5], dout.contiguous(), ctx.opts, kept)
        return dq, dk, dv, None


def flex_allgather(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float | None, group, groups: int = 1) -> Tensor:
    """FlexAttention of this rank's rows (q, k, v: the rank's shares of the sequence) under
    `block_mask` (the whole sequence's BlockMask, or this rank's rows against the whole sequence's
    keys), with K/V all-gathered in `groups` head groups."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return FlexAllGather.apply(q, k, v, Options(flex.Blocks.of(block_mask), scale, group, groups))
