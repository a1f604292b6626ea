"""The `by_expert` schedule: the token exchange pipelined with the experts chunk by chunk of experts.

A rank's nl local experts are cut into C chunks of consecutive experts (from three chunks on the
first and last are half the size of the others: chunk_weights).  Chunk c's exchange is one
all-to-all of the rows routed to chunk c's experts of every rank (each rank's share of it is a
contiguous piece of its run for that rank, the runs being expert-major), so the experts of chunk c
start as soon as chunk c has arrived, while later chunks are still on the way, and chunk c's
outputs go home while later chunks compute:

    forward   every chunk's dispatch posted at once (they run in order, the first arrives first)
              for c: wait dispatch c; SwiGLU of chunk c's experts; post combine c
              wait every combine
    backward  every chunk's output gradient posted home-to-expert at once
              for c: wait; the data gradients of chunk c; post its input gradient home
              the weight gradients of all experts in one grouped GEMM each, while those travel
              wait every input gradient

Unlike pieces by source (`by_peer`), no GEMM shrinks: a chunk holds every source's rows of its
experts, so each expert's GEMMs keep their whole size, and the weight gradients are computed once
over all rows at the end of the backward, never summed over pieces
(benchmarks/results/moe_pieces_*: what pieces by source and by expert cost the compute).

The experts are GroupedExperts' SwiGLU, torchtitan's `_run_experts_grouped_mm` written out with its
backward: h1 = x W1^T, h3 = x W3^T, a = silu(h1) * h3, y = a W2^T, in x's dtype.  On a GPU in bf16
each product is one `torch._grouped_mm` over groups padded to ALIGN rows (the grouped GEMM takes no empty
group, and its weight-gradient form needs 16-byte aligned group starts); otherwise a loop over the
experts.  Padding rows are zero, so they add nothing to any gradient.

Transfers: by the copy engine over symmetric memory where every rank can map its peers' memory
(ce_exchange.py; TORCH_COMMOPT_MOE_TRANSPORT=nccl turns it off).  Otherwise (`_post`): on NCCL,
`all_to_all` of per-rank views with `async_op=True`: each chunk's piece for rank q is read
straight out of x, and what comes home lands straight in the output, so nothing is packed or
unpacked; they run on NCCL's stream, beside the experts' GEMMs.  On gloo, whose list form takes
equal sizes only, the pieces are packed into one `all_to_all_single`; with CUDA tensors (ranks
sharing one GPU) staged through host memory (exchange.staged).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch_commopt.kernels.moe import exchange
from torch_commopt.kernels.moe.ce_exchange import IN, OUT, CEExchange, exchange_for
from torch_commopt.kernels.moe.exchange import Routing
from torch_commopt.kernels.moe.runs import RunTable, copy_runs, on_device, other, table

ALIGN = 8  # rows per group on the GPU (bf16: 16-byte aligned group starts in the weight gradients)
DEFAULT_CHUNKS = 2  # chunks of experts when the schedule names none (benchmarks/results/moe_pieces_*)


def chunk_weights(chunks: int) -> list[int]:
    """Relative sizes of the chunks: two even halves; from three on, the first and the last half
    the size of the others (what is exposed is the first chunk's dispatch and the last one's
    combine, so they are kept small, and the middle ones large enough to keep the GEMMs whole)."""
    return [1] * chunks if chunks <= 2 else [1] + [2] * (chunks - 2) + [1]


def chunk_bounds(local_experts: int, chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) local-expert ranges of `chunks` chunks sized by chunk_weights (fewer chunks when
    there are fewer experts; every chunk has at least one)."""
    chunks = max(1, min(chunks, local_experts))
    weights = chunk_weights(chunks)
    total, at, ends = sum(weights), 0, []
    for c, w in enumerate(weights):
        at += w
        lowest = (ends[-1] if ends else 0) + 1  # at least one expert in this chunk
        highest = local_experts - (chunks - 1 - c)  # and one left for each later chunk
        ends.append(min(highest, max(lowest, round(local_experts * at / total))))
    return list(zip([0] + ends[:-1], ends))


@dataclass(frozen=True)
class Plan:
    """Host-side layout of one by_expert call: what its transfers need, host arithmetic on the
    Routing and nothing more (it is made between the counts' host read and the first transfer,
    while the GPU waits; the run tables come after the first transfers are posted: `tables`).

    slices[c][q]: (start, rows) of x's rows that chunk c sends to rank q, a contiguous piece of
        x's run for q (x is sorted by expert, so by destination);
    send[c] / recv[c]: chunk c's rows per destination / per source;
    rows[c]: chunk c's [start, end) rows in the padded expert-major buffer; experts[c]: its [lo, hi)
        local experts;
    group_sizes / starts: padded rows and first row per local expert in that buffer;
    routing: the call's Routing (the run tables' rows per source and expert)."""

    slices: list[list[tuple[int, int]]]
    send: list[list[int]]
    recv: list[list[int]]
    rows: list[tuple[int, int]]
    experts: list[tuple[int, int]]
    group_sizes: list[int]
    starts: list[int]
    padded_rows: int
    peak: int | None  # Routing.peak: sizes the copy-engine exchange's slots
    routing: Routing


@dataclass(frozen=True)
class Tables:
    """A Plan's tables on x's device, from one host-to-device copy (runs.on_device), made once the
    forward's transfers are posted (they need the Plan only): the copy and its set-up then run
    while the first chunk is on its way, not while the GPU waits.

    landed[c]: runs from chunk c's received rows (source-major, as they land over
        torch.distributed) to the padded expert-major buffer of every local expert;
    placed[c] (the copy engine's exchange): the same from where the pieces lie, this rank's own
        piece (source rows >= 0) and the peers' in this rank's slots (negative: runs.other), so
        that one launch places the chunk whatever the world; slot_rows: the rows of a slot they
        were laid out for; at_slot[c][p]: the slot row chunk c's piece from peer p lands at, which
        the exchange's own count must match;
    back[c]: runs from the chunk's rows of that buffer (counted from its first row) to the
        source-major order they go home in;
    pads: the buffer's padding rows, an index (zeroed: they must add nothing to a weight gradient;
        at most align - 1 rows an expert, so one index_fill_ launch, cheaper on the host than a kernel's);
    groups: padded rows per local expert; offsets[c]: chunk c's grouped-GEMM group ends (int32)."""

    landed: list[RunTable]
    placed: list[RunTable] | None
    slot_rows: int | None
    at_slot: list[list[int]] | None
    back: list[RunTable]
    pads: Tensor
    groups: Tensor
    offsets: list[Tensor]


def layout(routing: Routing, align: int) -> tuple[list[int], list[int], list[int]]:
    """(rows, padded rows, first row) of each local expert in the padded expert-major buffer:
    expert e's rows from every source, source-major within it, padded to `align` (at least one
    group of `align` rows: the grouped GEMM takes no empty group)."""
    sizes = [sum(column) for column in zip(*routing.recv, strict=True)]
    padded = [max(align, -(-s // align) * align) if align > 1 else s for s in sizes]
    return sizes, padded, list(accumulate(padded, initial=0))[:-1]


def plan(routing: Routing, chunks: int, align: int) -> Plan:
    """The call's transfer layout, on the host from the Routing alone: no run, no tensor."""
    world = routing.world
    bounds = chunk_bounds(routing.local_experts, chunks)
    _, padded, starts = layout(routing, align)
    slices, send, recv, rows = [], [], [], []
    for lo, hi in bounds:
        slices.append([(routing.send_offset(q) + sum(routing.send[q][:lo]), sum(routing.send[q][lo:hi]))
                       for q in range(world)])
        send.append([n for _, n in slices[-1]])
        recv.append([sum(routing.recv[p][lo:hi]) for p in range(world)])
        rows.append((starts[lo], starts[hi - 1] + padded[hi - 1]))
    return Plan(slices, send, recv, rows, bounds, padded, starts, sum(padded), routing.peak, routing)


def _runs(p: Plan, slot_rows: int | None) -> tuple[list[list[tuple[int, int, int]]], list[list[int]]]:
    """Per chunk, its run tables as the host keeps them -- landed, back and, given the copy-engine
    slots' rows (slot_rows), placed (Tables) -- and the slot row each peer's piece lands at."""
    routing, runs, at_slot = p.routing, [], []
    got = [0] * routing.world  # rows each source has landed in its slot before this chunk
    for (lo, hi), (first, _) in zip(p.experts, p.rows, strict=True):
        filled = list(p.starts[lo:hi])  # the next free row of each of the chunk's experts
        landed, back, placed, at = [], [], [], 0
        if slot_rows is not None:
            at_slot.append([src * slot_rows + got[src] for src in range(routing.world)])
        for src in range(routing.world):
            piece = 0
            for e in range(lo, hi):
                n = routing.recv[src][e]
                landed.append((at + piece, filled[e - lo], n))
                back.append((filled[e - lo] - first, at + piece, n))
                if slot_rows is not None:
                    placed.append((piece if src == routing.rank else other(at_slot[-1][src] + piece), filled[e - lo], n))
                filled[e - lo] += n
                piece += n
            got[src] += piece
            at += piece
        runs += [table(landed), table(back)] + ([table(placed)] if slot_rows is not None else [])
    return runs, at_slot


def tables(p: Plan, device, slot_rows: int | None = None) -> Tables:
    """p's run tables, padding rows and group sizes and ends on `device`, from one host-to-device
    copy.  slot_rows: the rows of a copy-engine exchange's slot (its pieces are placed from there),
    None over torch.distributed."""
    sizes = [sum(column) for column in zip(*p.routing.recv, strict=True)]
    pad_rows = [row for e, (first, n) in enumerate(zip(p.starts, sizes)) for row in range(first + n, first + p.group_sizes[e])]
    ends = [at for lo, hi in p.experts for at in accumulate(p.group_sizes[lo:hi])]  # from each chunk's first row
    runs, at_slot = _runs(p, slot_rows)
    chunk_tables, (pads, groups, ends) = on_device(runs, device, (pad_rows, p.group_sizes, ends))
    per_chunk = len(chunk_tables) // len(p.rows)
    placed = chunk_tables[2::per_chunk] if slot_rows is not None else None
    offsets = list(ends.to(torch.int32).split([hi - lo for lo, hi in p.experts]))  # the grouped GEMM's offs
    return Tables(chunk_tables[0::per_chunk], placed, slot_rows, at_slot or None, chunk_tables[1::per_chunk], pads,
                  groups, offsets)


def gmm(x: Tensor, w: Tensor, sizes: list[int], offs: Tensor | None) -> Tensor:
    """Per expert e: x's rows of group e @ w[e]^T (w (E, out, in)), groups of `sizes` rows."""
    if offs is not None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    outs = [xe @ w[e].T for e, xe in enumerate(x.split(sizes))]
    return torch.cat(outs) if outs else x.new_zeros((0, w.shape[1]))


def gmm_wgrad(dy: Tensor, x: Tensor, sizes: list[int], offs: Tensor | None) -> Tensor:
    """Per expert e: dy's rows of group e ^T @ x's rows of group e -> (E, out, in)."""
    if offs is not None:
        return torch._grouped_mm(dy.transpose(-2, -1), x, offs=offs)
    return torch.stack([a.T @ b for a, b in zip(dy.split(sizes), x.split(sizes))])


class _Unpacked:
    """A packed all-to-all's work: waiting for it copies the packed rows into their places."""

    def __init__(self, work, packed: Tensor, outs: list[Tensor]):
        self.work, self.packed, self.outs = work, packed, outs

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        for o, t in zip(self.outs, self.packed.split([o.shape[0] for o in self.outs])):
            o.copy_(t)


def _post(outs: list[Tensor], ins: list[Tensor], group):
    """all_to_all of per-rank pieces, posted: its work.  On NCCL each piece is a view that NCCL reads
    or writes in place (a group of sends and receives: nothing is packed).  Gloo's list form takes
    equal sizes only, so there the pieces are packed into one all_to_all_single and unpacked on
    waiting; with CUDA tensors through host memory, completed before this returns."""
    if dist.get_backend(group) == "nccl":
        return dist.all_to_all(outs, ins, group=group, async_op=True)
    in_splits, out_splits = [t.shape[0] for t in ins], [o.shape[0] for o in outs]
    packed_in = torch.cat(ins)
    packed = packed_in.new_empty((sum(out_splits),) + tuple(outs[0].shape[1:]))
    if exchange.staged(packed_in, group):  # completed here, through host memory
        exchange.all_to_all_single(packed, packed_in, out_splits, in_splits, group)
        return _Unpacked(None, packed, outs)
    return _Unpacked(dist.all_to_all_single(packed, packed_in, out_splits, in_splits, group=group, async_op=True),
                     packed, outs)


def _pieces(t: Tensor, spans: list[tuple[int, int]]) -> list[Tensor]:
    return [t[start: start + n] for start, n in spans]


def _wait(work) -> None:
    if work is not None:
        work.wait()


def _landing(ex, p: Plan, like: Tensor) -> list[Tensor] | None:
    """Where each chunk's pieces land: on the copy engine nowhere but their slots (the caller
    reads them in place, Arrival.place); over torch.distributed one (chunk rows, D) buffer a
    chunk, like `like`, its rows source-major."""
    if isinstance(ex, CEExchange):
        return None
    return [like.new_empty((sum(r), like.shape[1])) for r in p.recv]


def _place(dst: Tensor, work, landing: list[Tensor] | None, p: Plan, t: Tables, c: int) -> None:
    """dst's rows of chunk c (the padded expert-major buffer) <- chunk c's pieces, once landed."""
    if landing is None:  # straight out of the slots and this rank's own piece, one run copy
        work.place(dst, t.placed[c], p.recv[c], t.at_slot[c])
        return
    _wait(work)
    copy_runs(dst, landing[c], t.landed[c])


def _back(y: Tensor, p: Plan, t: Tables, c: int) -> Tensor:
    """Chunk c's rows of y (expert-major, padded, from the chunk's first row) in the source-major
    order they go home in."""
    out = y.new_empty((sum(p.recv[c]), y.shape[1]))
    copy_runs(out, y, t.back[c])
    return out


def _post_all(ex, region: int, p: Plan, src: Tensor, landing: list[Tensor] | None) -> list:
    """Every chunk's pieces of src (x's rows, or their gradients) posted to the experts' ranks."""
    return [ex.post(region, c, None if landing is None else list(landing[c].split(p.recv[c])),
                    _pieces(src, p.slices[c])) for c in range(len(p.rows))]


class _ByExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, p: Plan, group) -> Tensor:
        dt = x.dtype
        w1c, w2c, w3c = (w.to(dt) for w in (w1, w2, w3))
        grouped = _grouped(x)
        x = x.contiguous()
        ex = exchange_for(x, group, p.peak, f"by_expert forward, {len(p.rows)} chunks", _post)
        landing = _landing(ex, p, x)
        works = _post_all(ex, IN, p, x, landing)
        t = tables(p, x.device, ex.slot_rows() if isinstance(ex, CEExchange) else None)  # while the first chunk travels
        xe = x.new_empty((p.padded_rows, x.shape[1]))  # every local expert's rows, padded, expert-major
        xe.index_fill_(0, t.pads, 0)
        # the SwiGLU's product over every chunk's rows, which the backward's w2 gradient reads as it is
        act = x.new_empty((p.padded_rows, w1c.shape[1]))
        out = x.new_empty((x.shape[0], w2.shape[1]))
        homes, saved = [], []
        for c, (start, end) in enumerate(p.rows):
            _place(xe, works[c], landing, p, t, c)
            xc = xe[start:end]
            sizes, offs = _chunk_groups(p, t, c, grouped)
            lo, hi = p.experts[c]
            h1 = gmm(xc, w1c[lo:hi], sizes, offs)
            h3 = gmm(xc, w3c[lo:hi], sizes, offs)
            silu = F.silu(h1)
            torch.mul(silu, h3, out=act[start:end])
            y = gmm(act[start:end], w2c[lo:hi], sizes, offs)
            back = _back(y, p, t, c)  # source-major, as the chunk came
            homes.append((ex.post(OUT, c, _pieces(out, p.slices[c]), list(back.split(p.recv[c]))), back))
            saved.append((h1, h3, silu))  # what autograd would keep: the backward recomputes nothing
        ex.release(IN)
        for work, _ in homes:
            _wait(work)
        ex.release(OUT)
        ex.close()
        ctx.save_for_backward(xe, act, w1c, w2c, w3c)
        ctx.chunks, ctx.plan, ctx.tables, ctx.group, ctx.wdtypes = saved, p, t, group, (w1.dtype, w2.dtype, w3.dtype)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        """The data gradients chunk by chunk, each chunk's input gradient posted home as soon as it
        is computed; the weight gradients over all rows while those travel.  What autograd does
        not ask for is neither computed nor sent: without x's gradient (an input that needs none)
        no input gradient travels home at all (the same on every rank: SPMD autograd)."""
        xe, act, w1c, w2c, w3c = ctx.saved_tensors
        p, t, group, saved = ctx.plan, ctx.tables, ctx.group, ctx.chunks
        want_x, want_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[1:4])
        grouped = _grouped(dout)
        dout = dout.contiguous()
        ex = exchange_for(dout, group, p.peak, f"by_expert backward, {len(p.rows)} chunks", _post)
        landing = _landing(ex, p, dout)
        works = _post_all(ex, IN, p, dout, landing)
        if isinstance(ex, CEExchange) and t.slot_rows != ex.slot_rows():  # not the forward's exchange's slots
            t = tables(p, dout.device, ex.slot_rows())
        # whole-call buffers that each chunk writes its rows of in place (elementwise out=), so
        # that the weight gradients run once over all rows, with nothing to concatenate
        dy = dout.new_empty((p.padded_rows, dout.shape[1]))
        dy.index_fill_(0, t.pads, 0)
        hidden = (p.padded_rows, w1c.shape[1])
        dh1, dh3 = dout.new_empty(hidden), dout.new_empty(hidden)
        dx = dout.new_empty((dout.shape[0], w1c.shape[2])) if want_x else None
        homes = []
        for c, (start, end) in enumerate(p.rows):
            _place(dy, works[c], landing, p, t, c)
            h1, h3, silu = saved[c]
            sizes, offs = _chunk_groups(p, t, c, grouped)
            lo, hi = p.experts[c]
            da = gmm(dy[start:end], w2c[lo:hi].transpose(-2, -1), sizes, offs)
            torch.mul(da, silu, out=dh3[start:end])
            torch.ops.aten.silu_backward.grad_input(da * h3, h1, grad_input=dh1[start:end])
            if want_x:
                dxc = gmm(dh1[start:end], w1c[lo:hi].transpose(-2, -1), sizes, offs)
                dxc += gmm(dh3[start:end], w3c[lo:hi].transpose(-2, -1), sizes, offs)
                back = _back(dxc, p, t, c)
                homes.append((ex.post(OUT, c, _pieces(dx, p.slices[c]), list(back.split(p.recv[c]))), back))
        ex.release(IN)
        # every chunk's input gradient on its way home: the weight gradients meanwhile
        dw1 = dw2 = dw3 = None
        if want_w:
            offs = torch.cumsum(t.groups, 0, dtype=torch.int32) if grouped else None
            t1, t2, t3 = ctx.wdtypes
            dw2 = gmm_wgrad(dy, act, p.group_sizes, offs).to(t2)
            dw1 = gmm_wgrad(dh1, xe, p.group_sizes, offs).to(t1)
            dw3 = gmm_wgrad(dh3, xe, p.group_sizes, offs).to(t3)
        for work, _ in homes:
            _wait(work)
        if want_x:
            ex.release(OUT)
        ex.close()
        ctx.chunks = ctx.tables = None
        return dx, dw1, dw2, dw3, None, None


def _grouped(t: Tensor) -> bool:
    """Whether the products run as torch._grouped_mm (bf16 on a GPU; else a loop over the experts)."""
    return t.is_cuda and t.dtype == torch.bfloat16


def _chunk_groups(p: Plan, t: Tables, c: int, cuda: bool):
    lo, hi = p.experts[c]
    return p.group_sizes[lo:hi], (t.offsets[c] if cuda else None)


def by_expert(x: Tensor, routing: Routing, weights: tuple[Tensor, Tensor, Tensor], group, chunks: int,
              align: int | None = None, compute_dtype: torch.dtype | None = None) -> Tensor:
    """The experts' outputs for x's rows (see the module docstring); differentiable in x and the
    weights (w1 (nl, H, D), w2 (nl, D, H), w3 (nl, H, D): this rank's experts).  align: rows per
    padded group (default ALIGN on a GPU, none elsewhere).  compute_dtype: the experts and the
    exchange in this dtype, the output back in x's (torchtitan's grouped GEMM path computes in
    bf16 whatever x's dtype); default x's."""
    w1, w2, w3 = weights
    if w1.shape[0] != routing.local_experts:
        raise ValueError(f"commopt moe: {w1.shape[0]} local experts' weights, the routing has {routing.local_experts}")
    p = plan(routing, chunks, align if align is not None else (ALIGN if x.is_cuda else 1))
    if compute_dtype is None or compute_dtype == x.dtype:
        return _ByExpert.apply(x, w1, w2, w3, p, group)
    return _ByExpert.apply(x.to(compute_dtype), w1, w2, w3, p, group).to(x.dtype)
