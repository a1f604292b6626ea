"""The `by_expert` schedule: the token exchange pipelined with the experts chunk by chunk of experts.

A rank's nl local experts are cut into C chunks of consecutive experts.  Chunk c's exchange is one
all-to-all of the rows routed to chunk c's experts of every rank (each rank's share of it is a
contiguous piece of its run for that rank, the runs being expert-major), so the experts of chunk c
start as soon as chunk c has arrived, while later chunks are still on the way, and chunk c's
outputs go home while later chunks compute:

    forward   every chunk's dispatch posted at once (they run in order, the first arrives first)
              for c: wait dispatch c; SwiGLU of chunk c's experts; post combine c
              wait every combine
    backward  every chunk's output gradient posted home-to-expert at once
              for c: wait; the data gradients of chunk c; post its input gradient home
              the weight gradients, chunk by chunk of experts, while those travel
              wait every input gradient

Unlike pieces by source (`by_peer`), no GEMM shrinks: a chunk holds every source's rows of its
experts, so each expert's GEMMs keep their whole size, and an expert's weight gradient comes from
its one chunk, never summed over pieces
(benchmarks/results/moe_pieces_*: what pieces by source and by expert cost the compute).

The experts are GroupedExperts' SwiGLU, torchtitan's `_run_experts_grouped_mm` written out with its
backward: h1 = x W1^T, h3 = x W3^T, a = silu(h1) * h3, y = a W2^T, in x's dtype.  On a GPU in bf16
each product is one `torch._grouped_mm` over groups padded to ALIGN rows (the grouped GEMM takes no empty
group, and its weight-gradient form needs 16-byte aligned group starts); otherwise a loop over the
experts.  Padding rows are zero, so they add nothing to any gradient.

Transfers: `all_to_all_single` with `async_op=True` (on NCCL they run on NCCL's stream, under the
experts' GEMMs); with gloo and CUDA tensors (ranks sharing one GPU) they are staged through host
memory and complete before the call returns (exchange._staged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch_commopt.kernels.moe.exchange import Routing, _staged, ranges

ALIGN = 8  # rows per group on the GPU (bf16: 16-byte aligned group starts in the weight gradients)
DEFAULT_CHUNKS = 2  # chunks of experts when the schedule names none (benchmarks/results/moe_pieces_*)


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) local-expert ranges of `chunks` near-equal chunks (fewer when there are fewer experts)."""
    chunks = max(1, min(chunks, local_experts))
    base, extra = divmod(local_experts, chunks)
    bounds, lo = [], 0
    for c in range(chunks):
        hi = lo + base + (c < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@dataclass(frozen=True)
class Plan:
    """Host-side layout of one by_expert call (indices are built once per call, on x's device).

    perm: x's rows in send order (chunk-major, then destination, then expert); perms[c]: chunk c's;
    send[c] / recv[c]: chunk c's all-to-all split sizes (per destination / per source);
    place[c]: for chunk c's received rows (source-major), their row in the padded expert-major buffer;
    rows[c]: chunk c's [start, end) rows in that buffer; experts[c]: its [lo, hi) local experts;
    groups / group_sizes: padded rows per local expert (on the device / on the host)."""

    perm: Tensor
    perms: list[Tensor]
    send: list[list[int]]
    recv: list[list[int]]
    place: list[Tensor]
    rows: list[tuple[int, int]]
    experts: list[tuple[int, int]]
    groups: Tensor
    group_sizes: list[int]
    padded_rows: int


def plan(routing: Routing, chunks: int, device, align: int) -> Plan:
    world, nl = routing.world, routing.local_experts
    bounds = chunk_bounds(nl, chunks)
    # padded expert-major buffer: expert e's rows from every source, source-major within it
    sizes = [sum(routing.recv[p][e] for p in range(world)) for e in range(nl)]
    padded = [max(align, -(-s // align) * align) if align > 1 else s for s in sizes]
    starts = [sum(padded[:e]) for e in range(nl)]
    perm, send, recv, place, rows = [], [], [], [], []
    for lo, hi in bounds:
        send_c, place_c = [], []
        for q in range(world):
            n = sum(routing.send[q][lo:hi])
            perm.append((routing.send_offset(q) + sum(routing.send[q][:lo]), n))
            send_c.append(n)
        filled = {e: 0 for e in range(lo, hi)}
        for p in range(world):
            for e in range(lo, hi):
                place_c.append((starts[e] + filled[e], routing.recv[p][e]))
                filled[e] += routing.recv[p][e]
        send.append(send_c)
        recv.append([sum(routing.recv[p][lo:hi]) for p in range(world)])
        place.append(ranges(place_c, device))
        rows.append((starts[lo], starts[hi - 1] + padded[hi - 1]))
    return Plan(ranges(perm, device), [ranges(perm[c * world:(c + 1) * world], device) for c in range(len(bounds))],
                send, recv, place, rows, bounds, torch.tensor(padded, dtype=torch.int64).to(device), padded, sum(padded))


def _gmm(x: Tensor, w: Tensor, sizes: list[int], offs: Tensor | None) -> Tensor:
    """Per expert e: x's rows of group e @ w[e]^T (w (E, out, in)), groups of `sizes` rows."""
    if offs is not None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    outs = [xe @ w[e].T for e, xe in enumerate(x.split(sizes))]
    return torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))


def _gmm_wgrad(dy: Tensor, x: Tensor, sizes: list[int], offs: Tensor | None) -> Tensor:
    """Per expert e: dy's rows of group e ^T @ x's rows of group e -> (E, out, in)."""
    if offs is not None:
        return torch._grouped_mm(dy.transpose(-2, -1), x, offs=offs)
    return torch.stack([a.T @ b for a, b in zip(dy.split(sizes), x.split(sizes))])


def _post(out: Tensor, x: Tensor, out_splits: list[int], in_splits: list[int], group):
    """all_to_all_single posted: its work (None when it already completed: staged through host)."""
    if _staged(x, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, x.cpu(), out_splits, in_splits, group=group)
        out.copy_(host)
        return None
    return dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _sends(t: Tensor, p: Plan) -> list[Tensor]:
    """t's rows as each chunk sends them (one chunk: t itself, already in send order)."""
    if len(p.perms) == 1:
        return [t.contiguous()]
    return list(t.index_select(0, p.perm).split([sum(s) for s in p.send]))


def _home(pieces: list[Tensor], p: Plan, like: Tensor) -> Tensor:
    """The chunks' returned rows back in x's row order."""
    if len(pieces) == 1:
        return pieces[0]
    out = like.new_empty((sum(t.shape[0] for t in pieces), pieces[0].shape[1]))
    for c, t in enumerate(pieces):
        out.index_copy_(0, p.perms[c], t)
    return out


def _cat(ts: list[Tensor]) -> Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


class _ByExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, p: Plan, group) -> Tensor:
        dt = x.dtype
        w1c, w2c, w3c = (w.to(dt) for w in (w1, w2, w3))
        grouped = _grouped(x)
        sends = _sends(x, p)
        recvd = [x.new_empty((sum(r), x.shape[1])) for r in p.recv]
        works = [_post(recvd[c], sends[c], p.recv[c], p.send[c], group) for c in range(len(p.send))]
        outs = [x.new_empty((sum(s), w2.shape[1])) for s in p.send]
        homes, saved = [], []
        for c, (start, end) in enumerate(p.rows):
            _wait(works[c])
            place = p.place[c] - start
            xc = x.new_zeros((end - start, x.shape[1])).index_copy_(0, place, recvd[c])  # expert-major, padded
            sizes, offs = _chunk_groups(p, c, grouped)
            lo, hi = _experts(p, c)
            h1 = _gmm(xc, w1c[lo:hi], sizes, offs)
            h3 = _gmm(xc, w3c[lo:hi], sizes, offs)
            y = _gmm(F.silu(h1) * h3, w2c[lo:hi], sizes, offs)
            back = y.index_select(0, place)  # source-major, as the chunk came
            homes.append((_post(outs[c], back, p.send[c], p.recv[c], group), back))
            saved.append((xc, h1, h3))
        for work, _ in homes:
            _wait(work)
        ctx.save_for_backward(w1c, w2c, w3c)
        ctx.chunks, ctx.plan, ctx.group, ctx.wdtypes = saved, p, group, (w1.dtype, w2.dtype, w3.dtype)
        return _home(outs, p, x)

    @staticmethod
    def backward(ctx, dout: Tensor):
        w1c, w2c, w3c = ctx.saved_tensors
        p, group, saved = ctx.plan, ctx.group, ctx.chunks
        grouped = _grouped(dout)
        sends = _sends(dout, p)
        recvd = [dout.new_empty((sum(r), dout.shape[1])) for r in p.recv]
        works = [_post(recvd[c], sends[c], p.recv[c], p.send[c], group) for c in range(len(p.send))]
        dxs = [dout.new_empty((sum(s), w1c.shape[2])) for s in p.send]
        homes, for_weights = [], []
        for c, (start, end) in enumerate(p.rows):
            _wait(works[c])
            place = p.place[c] - start
            xc, h1, h3 = saved[c]
            dy = dout.new_zeros((end - start, dout.shape[1])).index_copy_(0, place, recvd[c])
            sizes, offs = _chunk_groups(p, c, grouped)
            lo, hi = _experts(p, c)
            silu = F.silu(h1)
            da = _gmm(dy, w2c[lo:hi].transpose(-2, -1), sizes, offs)
            dh3 = da * silu
            dh1 = torch.ops.aten.silu_backward(da * h3, h1)
            dxc = _gmm(dh1, w1c[lo:hi].transpose(-2, -1), sizes, offs)
            dxc += _gmm(dh3, w3c[lo:hi].transpose(-2, -1), sizes, offs)
            back = dxc.index_select(0, place)
            homes.append((_post(dxs[c], back, p.send[c], p.recv[c], group), back))
            for_weights.append((dy, silu * h3, dh1, dh3, xc, sizes, offs))
        # every chunk's input gradient on its way home: the weight gradients, per chunk of experts
        # (a chunk's experts see only its rows: nothing to sum)
        dw1, dw2, dw3 = [], [], []
        for dy, act, dh1, dh3, xc, sizes, offs in for_weights:
            dw2.append(_gmm_wgrad(dy, act, sizes, offs))
            dw1.append(_gmm_wgrad(dh1, xc, sizes, offs))
            dw3.append(_gmm_wgrad(dh3, xc, sizes, offs))
        for work, _ in homes:
            _wait(work)
        ctx.chunks = None
        t1, t2, t3 = ctx.wdtypes
        return _home(dxs, p, dout), _cat(dw1).to(t1), _cat(dw2).to(t2), _cat(dw3).to(t3), None, None


def _grouped(t: Tensor) -> bool:
    """Whether the products run as torch._grouped_mm (bf16 on a GPU; else a loop over the experts)."""
    return t.is_cuda and t.dtype == torch.bfloat16


def _experts(p: Plan, c: int) -> tuple[int, int]:
    """Chunk c's local experts [lo, hi)."""
    return p.experts[c]


def _chunk_groups(p: Plan, c: int, cuda: bool):
    lo, hi = _experts(p, c)
    sizes = p.group_sizes[lo:hi]
    offs = torch.cumsum(p.groups[lo:hi], 0, dtype=torch.int32) if cuda else None
    return sizes, offs


def by_expert(x: Tensor, routing: Routing, weights: tuple[Tensor, Tensor, Tensor], group, chunks: int,
              align: int | None = None) -> Tensor:
    """The experts' outputs for x's rows (see the module docstring); differentiable in x and the
    weights (w1 (nl, H, D), w2 (nl, D, H), w3 (nl, H, D): this rank's experts).  align: rows per
    padded group (default ALIGN on a GPU, none elsewhere)."""
    w1, w2, w3 = weights
    if w1.shape[0] != routing.local_experts:
        raise ValueError(f"commopt moe: {w1.shape[0]} local experts' weights, the routing has {routing.local_experts}")
    p = plan(routing, chunks, x.device, align if align is not None else (ALIGN if x.is_cuda else 1))
    return _ByExpert.apply(x, w1, w2, w3, p, group)
