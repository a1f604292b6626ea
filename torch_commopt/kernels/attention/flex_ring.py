"""The reference ring schedule of FlexAttention over a sequence-sharded Q, K and V (plain torch + c10d).

Rank p holds rows and keys [p * L, (p + 1) * L).  Forward: the K/V shares travel round the ring
(comm.ring_shift, W - 1 shifts); at step i rank p attends its rows to source s = (p - i) mod W's
keys under that block's mask (flex.step_mask) and merges the block's (out, lse) into its
accumulator (merge.Accumulator: the first block's partial kept as it came, later ones merged
over the rows their tiles reach).  A block whose mask keeps no tile (flex.extents) is not
computed: a sliding window or a document boundary leaves most of a long sequence's blocks empty.
Backward: the K/V shares travel round again, with their dK/dV sums in the acc dtype one step
behind them; each rank adds its block's terms, computed from its rows' *global* out and LSE, and
the sums reach their owner after W shifts.

Sends skipped and cut: where every rank holds the whole sequence's mask (not its own rows only)
and some rank needs none of another's keys, or only part of them (flex.spans: the key blocks
from the first a rank's rows keep a tile of to the last -- a sliding window, documents, a causal
mask over contiguous shares), the shares go straight from their owner to the ranks that need
them instead of round the ring, and only the span they need (DirectShift: step i, rank p
receives its span of source p - i's share from it and sends the span p + i needs of its own to
p + i, each only if there is one); in the backward each rank sends its terms of source s's
dK/dV, over the same span, straight to s, which adds them up (DirectGrads).  The steps, and what
each rank computes, are the ring's.  Documents dealt contiguously (balance.contiguous) then move
the documents that cross a share's end, not the shares.  Two ranks send directly even where the
sends cannot be cut (whole shares): the ring's fp32 sums would travel twice; the direct terms
go once in the inputs' dtype, and the owner's total starts as its own block's terms.

The mask is the program's whole-sequence BlockMask and its mask_mod of global positions
(flex.Blocks); every rank holds it, as a program that builds it from document ids on every rank
does.  The GPU schedules are checked against this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels.attention import comm, flex
from torch_commopt.kernels.attention.local import acc_dtype
from torch_commopt.kernels.attention.merge import Accumulator

TAG_KV, TAG_GRAD = 71, 72



def steps_of(blocks: flex.Blocks, world: int, p: int) -> tuple[list[flex.Step], list[flex.Extent | None]]:
    """Rank p's blocks against every source, and where their tiles lie (one host read); built
    once for a mask's tensors (flex.cached)."""

    def build():
        steps = [flex.step_mask(blocks, p, s, world) for s in range(world)]
        return steps, flex.extents(steps)

    return flex.cached(blocks, ("ring", p, world), build)


@dataclass(frozen=True)
class RankBlocks:
    """Rank p's side of the ring: its blocks per source (steps_of), the softmax scale, its rank
    and the ring's size; the order of sources is p, p - 1, ... (its own keys first)."""

    steps: list
    extents: list
    scale: float
    rank: int
    world: int

    def order(self) -> list[int]:
        return [(self.rank - i) % self.world for i in range(self.world)]


def forward_blocks(q: Tensor, v_dim: int, shift, ring: RankBlocks) -> tuple[Tensor, Tensor]:
    """The forward's compute over a K/V shift (comm.ring_shift's interface: current, start,
    wait, finish): (out, lse) as ring_forward gives them."""
    acc_t = acc_dtype(q.dtype)
    order = ring.order()
    computed = [s for s in order if ring.extents[s] is not None]
    acc = Accumulator(q, v_dim, acc_t)
    for i, s in enumerate(order):
        k_s, v_s = shift.current()
        if i < ring.world - 1:
            shift.start()
        if ring.extents[s] is not None:
            block_out, block_lse = flex.block_forward(q, k_s, v_s, ring.steps[s], ring.scale)
            # the first block's partial becomes the accumulator; a later one is merged over the
            # rows its tiles reach only (elsewhere it is empty)
            rows = slice(None) if s == computed[0] else ring.extents[s].rows
            acc.add(rows, block_out[:, :, rows], block_lse[:, :, rows].to(acc_t), last=s == computed[-1])
        if i < ring.world - 1:
            shift.wait()
    shift.finish()
    return acc.result()


Spans = list[list[tuple[int, int] | None]]


def skipping(blocks: flex.Blocks, world: int) -> Spans | None:
    """spans[p][s] (flex.spans) where a send can be skipped or cut -- the whole mask known, and
    some rank needing none of another's keys or only part of them --, else None: the plain ring.
    Built once per mask (flex.cached), the same on every rank."""
    if blocks.own_rows:
        return None

    def build():
        table = flex.spans(blocks, world)
        whole = (0, blocks.share(world))
        return None if all(table[p][s] == whole for p in range(world) for s in range(world) if p != s) else table

    return flex.cached(blocks, ("spans", world), build)


def _checked(spans: Spans | None, ring: RankBlocks) -> Spans | None:
    """spans, where its row for this rank holds what the rank's own cut computes (every block
    computed gets at least the keys its tiles reach): else a RuntimeError, not a wrong sum."""
    mine = [(e.keys.start, e.keys.stop) if e is not None else None for e in ring.extents]
    if spans is not None and not all(map(_covers, spans[ring.rank], mine)):
        raise RuntimeError(f"flex CP: rank {ring.rank}'s blocks' keys {mine} disagree with the mask's spans "
                           f"{spans[ring.rank]}")
    return spans


def _covers(got: tuple[int, int] | None, need: tuple[int, int] | None) -> bool:
    """Whether a received span `got` holds the keys `need` (None: nothing received / needed)."""
    return need is None or (got is not None and got[0] <= need[0] and need[1] <= got[1])


def _sends(blocks: flex.Blocks, world: int, ring: RankBlocks, group=None) -> Spans | None:
    """The spans the direct sends move (checked against this rank's cut), None for the plain ring.
    Two ranks whose sends cannot be cut (a rank's own rows' mask; or every span whole) still send
    directly, whole shares, unless the rings are asked to move by the copy engine
    (TORCH_COMMOPT_ATTENTION_TRANSPORT=ce; the direct sends are NCCL's): a ring of two moves the
    same K/V, but its backward's dK/dV sums travel in fp32 twice over (to the peer and back),
    where the direct terms go once, in the inputs' dtype, to be added at their owner."""
    from torch_commopt.kernels.attention import ce_ring

    if _first_in_capture(group):
        return None
    spans = skipping(blocks, world)
    if spans is None and world == 2 and ce_ring.transport() != "ce":
        spans = [[(0, blocks.share(world))] * world for _ in range(world)]
    return _checked(spans, ring)


def _first_in_capture(group) -> bool:
    """Whether the direct sends would meet the group for the first time inside a CUDA-graph
    capture, where _ready's barrier cannot run: the shares then go round the plain ring, which
    moves every share and computes the same blocks (the same on every rank: they capture
    together, and meet a group's first direct sends at the same call)."""
    return (group is not None and group.group_name not in _READY and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


def ring_forward(q: Tensor, k: Tensor, v: Tensor, blocks: flex.Blocks, scale: float, group, *,
                 keep: bool = False):
    """(out, lse) of this rank's rows over the whole sequence: out in q's dtype where at most
    two blocks were computed (the first is kept as it came, the second merged into it in fp32 and
    rounded once), else in the acc dtype; lse in the acc dtype.  keep: (out, lse, kept), kept the
    peer's K/V as this rank received them where two ranks send directly (pair_backward's; (None,
    None) where this rank needed none of them), else None (ring_backward's)."""
    world, p = comm.size(group), comm.rank(group)
    ring = RankBlocks(*steps_of(blocks, world, p), scale, p, world)
    spans = _sends(blocks, world, ring, group)
    shift = comm.ring_shift([k, v], group, TAG_KV) if spans is None else DirectShift([k, v], group, TAG_KV, spans)
    out, lse = forward_blocks(q, v.shape[-1], shift, ring)
    if not keep:
        return out, lse
    if spans is None or world != 2:
        return out, lse, None
    return out, lse, tuple(shift.held) if ring.extents[1 - p] is not None else (None, None)


def pair_backward(saved: "Saved", dout: Tensor, blocks: flex.Blocks, scale: float, group,
                  kept: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """ring_backward over two ranks that send directly, from the peer's K/V kept by the forward
    (ring_forward(keep=True)): nothing is sent again; the block against the peer's keys runs
    first and its dK/dV terms travel to their owner while the own block runs; the sums and their
    rounding are ring_backward's (dq: the own block's, the other's added over its rows; dK/dV: the
    own block's terms, the arriving span added).  Every rank of the pair takes this path together
    (where the forward kept, i.e. wherever the two send directly)."""
    q, k, v, out, lse = saved.q, saved.k, saved.v, saved.out, saved.lse
    p = comm.rank(group)
    ring = RankBlocks(*steps_of(blocks, 2, p), scale, p, 2)
    spans, s = _sends(blocks, 2, ring, group), 1 - p
    out_q, moves = out.to(q.dtype), _Direct([k, v], group, TAG_GRAD, spans)
    cross = None
    if ring.extents[s] is not None:
        cross = flex.block_backward(q, kept[0], kept[1], out_q, lse, dout, ring.steps[s], scale)
        _zero_outside(cross[1:], ring.extents[s].keys)  # as the ring's sums leave them
    # what the peer waits for: a span of terms wherever the table holds one, zeros if no tile
    # reached it (the table, not the tiles, tells both ranks what moves)
    mine, theirs = spans[p][s], spans[s][p]
    terms = list(cross[1:]) if cross is not None else [torch.zeros_like(k), torch.zeros_like(v)]
    moves.post(moves.pack(terms, mine) if mine else None, s, (s, theirs) if theirs else None)
    dq, totals = _own_terms(q, k, v, (out_q, lse, dout), ring)
    if cross is not None and dq is None:
        dq = cross[0]
    elif cross is not None:
        rows = ring.extents[s].rows
        dq[:, :, rows] += cross[0][:, :, rows]
    if moves.pending is not None:
        moves.pending()
    if moves.got is not None:
        a, b = theirs
        for total, part in zip(totals, moves.unpack(moves.got, theirs), strict=True):
            total[:, :, a:b] += part
    dq = torch.zeros_like(q) if dq is None else dq
    return dq.to(q.dtype), totals[0].to(k.dtype), totals[1].to(v.dtype)


def _own_terms(q: Tensor, k: Tensor, v: Tensor, rows: tuple, ring: RankBlocks) -> tuple:
    """(dq or None, [dK, dV] totals) of the own block (zeroed outside the keys its tiles reach;
    zeros in the inputs' dtype where it has no tile).  rows: out in q's dtype, lse, dout."""
    own = ring.extents[ring.rank]
    if own is None:
        return None, [torch.zeros_like(k), torch.zeros_like(v)]
    gq, gk, gv = flex.block_backward(q, k, v, *rows, ring.steps[ring.rank], ring.scale)
    return gq, _zero_outside([gk, gv], own.keys)


def _zero_outside(grads, keys: slice) -> list[Tensor]:
    """A block's dK/dV terms (B, H, L, D), zeroed in place outside the keys its tiles reach."""
    for g in grads:
        g[:, :, :keys.start].zero_()
        g[:, :, keys.stop:].zero_()
    return list(grads)


_READY: set[str] = set()  # groups whose communicator the direct sends have made sure of


def _ready(group) -> None:
    """Before a group's first direct sends: one barrier of every rank.  A step where a rank has
    nothing to send or receive is skipped by it, and NCCL wants every rank of a group in the first
    point-to-point batch that creates the group's communicator.  Every rank takes the direct path
    at the same calls (the needs table is the same everywhere), so they all come here together."""
    name = group.group_name
    if name not in _READY:
        dist.barrier(group=group)
        _READY.add(name)


class _Direct:
    """What DirectShift and DirectGrads share: the tensors ((B, H, L, D) shares, cut along the
    sequence), the group, the spans table, the step.  A transfer of part of a share is one
    message, the tensors' rows of its span packed one after another; a whole share goes as the
    tensors themselves, one message each, and lands in tensors of their own (nothing packed,
    nothing unpacked).  Both sides tell the two apart by the span alone."""

    def __init__(self, tensors: list[Tensor], group, tag: int, spans: Spans) -> None:
        _ready(group)
        self.tensors = tensors
        self.group, self.tag, self.spans = group, tag, spans
        self.world, self.rank = comm.size(group), comm.rank(group)
        self.step, self.got, self.pending, self.sending = 0, None, None, None

    def _whole(self, span: tuple[int, int]) -> bool:
        return span == (0, self.tensors[0].shape[2])

    def pack(self, tensors: list[Tensor], span: tuple[int, int]) -> list[Tensor]:
        if self._whole(span):
            return [t.contiguous() for t in tensors]
        return [torch.cat([t[:, :, span[0]:span[1]].reshape(-1) for t in tensors])]

    def _shapes(self, span: tuple[int, int]) -> list[torch.Size]:
        """The tensors' shapes cut to the rows of `span`."""
        return [torch.Size(t.shape[:2] + (span[1] - span[0],) + t.shape[3:]) for t in self.tensors]

    def unpack(self, got: list[Tensor], span: tuple[int, int]) -> list[Tensor]:
        """The tensors' rows of `span`: the received tensors of a whole share, else views of the
        packed message."""
        return got if self._whole(span) else comm.views(got[0], self._shapes(span))

    def post(self, send: list[Tensor] | None, dst: int, recv: tuple[int, tuple[int, int]] | None) -> None:
        """Send `send` (pack's messages) to group rank dst (None: nothing) and receive the span
        recv = (src, span) from group rank src (None: nothing) into self.got; self.pending waits
        for both."""
        sends = [(t, dist.get_global_rank(self.group, dst), self.tag) for t in send or ()]
        self.sending, self.got = send, None  # the messages kept alive until the wait
        recvs = []
        if recv is not None:
            src, span = recv
            self.got = ([torch.empty_like(t, memory_format=torch.contiguous_format) for t in self.tensors]
                        if self._whole(span) else
                        [self.tensors[0].new_empty(sum(shape.numel() for shape in self._shapes(span)))])
            recvs = [(g, dist.get_global_rank(self.group, src), self.tag) for g in self.got]
        self.pending = comm._p2p(sends, recvs, self.group) if sends or recvs else None  # noqa: SLF001

    def finish(self) -> None:
        """After the last use of the current tensors (nothing to release here)."""


class DirectShift(_Direct):
    """comm.RingShift's interface (current, start, wait, finish), each share sent by its owner
    straight to the ranks that need it, and only the span of it they need: at step i rank p holds
    source (p - i)'s share, its span spans[p][p - i] received from that rank (zeros elsewhere: no
    tile reads them), and sends the span spans[p + i][p] of its own to p + i; a span of None is
    not sent (a step whose share is not needed computes nothing: current() then gives this
    rank's own)."""

    def __init__(self, tensors: list[Tensor], group, tag: int, spans: Spans) -> None:
        super().__init__(tensors, group, tag, spans)
        self.held, self.wanted = tensors, None

    def current(self) -> list[Tensor]:
        return self.held

    def start(self) -> None:
        i, n, p = self.step + 1, self.world, self.rank
        dst, src = (p + i) % n, (p - i) % n
        theirs, mine = self.spans[dst][p], self.spans[p][src]
        self.wanted = mine
        self.post(self.pack(self.tensors, theirs) if theirs else None, dst, (src, mine) if mine else None)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending()
        self.step += 1
        self.held = self.tensors
        if self.got is not None and self._whole(self.wanted):
            self.held = self.got
        elif self.got is not None:
            a, b = self.wanted
            self.held = [torch.zeros_like(t) for t in self.tensors]
            for full, part in zip(self.held, self.unpack(self.got, self.wanted), strict=True):
                full[:, :, a:b] = part
        self.pending = self.got = self.sending = None


@dataclass(frozen=True)
class Saved:
    """What the backward takes from the forward: the rank's shares and its rows' global out and lse."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def backward_blocks(saved: Saved, dout: Tensor, shifts: tuple, ring: RankBlocks) -> tuple[Tensor, Tensor, Tensor]:
    """The backward's compute over shifts = (K/V shift, dK/dV sums' shift): (dq, dk, dv) as
    ring_backward gives them.  dq sums the blocks' terms over the rows each reaches (in q's dtype
    where two or fewer blocks add, one rounding; else the acc dtype); the travelling dK/dV sums
    take each block's over the keys it reaches."""
    q, k, v, out, lse = saved.q, saved.k, saved.v, saved.out, saved.lse
    kv, grads = shifts
    dq = None
    wide = sum(e is not None for e in ring.extents) > 2
    out_q = out.to(q.dtype)
    for i, s in enumerate(ring.order()):
        k_s, v_s = kv.current()
        if i < ring.world - 1:
            kv.start()
        if ring.extents[s] is not None:
            gq, gk, gv = flex.block_backward(q, k_s, v_s, out_q, lse, dout, ring.steps[s], ring.scale)
            rows, keys = ring.extents[s].rows, ring.extents[s].keys
            if dq is None:
                dq = gq.to(acc_dtype(q.dtype)) if wide else gq
            else:
                dq[:, :, rows] += gq[:, :, rows]
            if not (i == 0 and getattr(grads, "adopt", lambda *_: False)(gk, gv, keys)):
                dk_s, dv_s = grads.current()
                dk_s[:, :, keys] += gk[:, :, keys]
                dv_s[:, :, keys] += gv[:, :, keys]
        grads.start()  # block s's sums to the next rank: after W shifts at their owner
        if i < ring.world - 1:
            kv.wait()
        grads.wait()
    kv.finish()
    dk, dv = grads.current()
    grads.finish()
    dq = torch.zeros_like(q) if dq is None else dq
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def ring_backward(saved: Saved, dout: Tensor, blocks: flex.Blocks, scale: float, group) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shares, in the inputs' dtypes."""
    world, p = comm.size(group), comm.rank(group)
    ring = RankBlocks(*steps_of(blocks, world, p), scale, p, world)
    spans = _sends(blocks, world, ring, group)
    # Over two ranks with sends cut, a rank's dK/dV total is its own block's terms plus at most one
    # arriving span: one sum, rounded once in the inputs' dtype as in fp32, so the own block's
    # terms become the total as the kernel gave them (no fp32 zeros over the share, no cast back).
    acc = saved.k.dtype if spans is not None and world == 2 else acc_dtype(saved.q.dtype)
    zeros = [torch.zeros(saved.k.shape, dtype=acc, device=saved.k.device),
             torch.zeros(saved.v.shape, dtype=acc, device=saved.v.device)]
    if spans is None:
        shifts = (comm.ring_shift([saved.k, saved.v], group, TAG_KV),
                  comm.ring_shift(zeros, group, TAG_GRAD, channel=1))  # both at once: two channels
    else:
        shifts = (DirectShift([saved.k, saved.v], group, TAG_KV, spans),
                  DirectGrads(zeros, group, TAG_GRAD, spans, adopt_own=world == 2))
    return backward_blocks(saved, dout, shifts, ring)


class DirectGrads(_Direct):
    """The dK/dV sums' shift of backward_blocks with each rank's terms sent straight to their
    owner, the span of keys they reach only: at step i current() gives the zeroed buffers for
    source (p - i)'s terms (step 0: this rank's own, which collects everything), start() sends
    their span spans[p][p - i] to that rank if it computed any and receives rank p + i's terms of
    this rank's keys (their span spans[p + i][p]) if it computed any, wait() adds those in; after
    the last step current() gives this rank's whole dK/dV."""

    def __init__(self, zeros: list[Tensor], group, tag: int, spans: Spans, adopt_own: bool = False) -> None:
        super().__init__(zeros, group, tag, spans)
        self.terms, self.arriving = zeros, None  # step 0: this rank's own terms, into the total itself
        self.adopt_own = adopt_own

    def adopt(self, gk: Tensor, gv: Tensor, keys: slice) -> bool:
        """At step 0 with adopt_own (two ranks, the totals in the terms' dtype): the own block's
        terms become the totals themselves instead of being added into zeros (outside `keys`, the
        keys its tiles reach, zeroed as the sum would leave them); False where they are added as
        usual."""
        if not self.adopt_own or self.step != 0 or gk.dtype != self.tensors[0].dtype:
            return False
        self.tensors = self.terms = _zero_outside([gk, gv], keys)
        return True

    def current(self) -> list[Tensor]:
        # (a step whose source this rank needs nothing of computes nothing: the total stands in, unwritten)
        return self.tensors if self.step >= self.world or self.terms is None else self.terms

    def start(self) -> None:
        i, n, p = self.step, self.world, self.rank
        if i == 0:  # this rank's own terms are in the total already
            self.pending = None
            return
        owner, src = (p - i) % n, (p + i) % n
        mine, theirs = self.spans[p][owner], self.spans[src][p]
        self.arriving = theirs
        self.post(self.pack(self.terms, mine) if self.terms is not None else None, owner,
                   (src, theirs) if theirs else None)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending()
        if self.got is not None:
            a, b = self.arriving
            for total, part in zip(self.tensors, self.unpack(self.got, self.arriving), strict=True):
                total[:, :, a:b] += part
        self.step += 1
        self.got = self.pending = self.sending = None
        if self.step < self.world:
            owner = (self.rank - self.step) % self.world
            self.terms = [torch.zeros_like(t) for t in self.tensors] if self.spans[self.rank][owner] else None


class FlexRing(torch.autograd.Function):
    """Ring FlexAttention with autograd: forward(q, k, v, blocks, scale, group) -> out in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, group):
        # two ranks that send directly keep the peer's K/V, as the all-gather keeps its gathered K/V
        out, lse, kept = ring_forward(q, k, v, blocks, scale, group, keep=True)
        ctx.paired = kept is not None
        ctx.save_for_backward(q, k, v, out, lse, *(t for t in kept or () if t is not None))
        ctx.blocks, ctx.scale, ctx.group = blocks, scale, group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        saved = ctx.saved_tensors
        if ctx.paired:
            kept = tuple(saved[5:]) or (None, None)
            grads = pair_backward(Saved(*saved[:5]), dout.contiguous(), ctx.blocks, ctx.scale, ctx.group, kept)
        else:
            grads = ring_backward(Saved(*saved), dout.contiguous(), ctx.blocks, ctx.scale, ctx.group)
        return *grads, None, None, None


def flex_ring(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float | None, group) -> Tensor:
    """FlexAttention of this rank's rows (q, k, v: (B, H, L, D), (B, H_kv, L, D), the rank's shares
    of the sequence) under `block_mask` (the whole sequence's BlockMask, or this rank's rows
    against the whole sequence's keys), over the ring."""
    blocks = flex.Blocks.of(block_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return FlexRing.apply(q, k, v, blocks, scale, group)
