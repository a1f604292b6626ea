"""Ulysses whose attention starts on the rank's own block (schedule `ulysses:early`).

After Ulysses's all-to-all a rank holds h = H/n heads over the whole sequence, n blocks of
L = S_loc tokens in rank order; block `me` is its own and needs no transfer.  Plain Ulysses
waits for every block, runs one attention over n*L tokens and sends every result back after
it, so each pass exposes its inputs' and its results' transfers (2x H100, 16K tokens, MHA:
~1 ms of an 8 ms training call, benchmarks/NOTES.md session 30).  Here the attention is cut
into blocks (query block i, a range of key blocks, a mask):

    early   (me, me): the own queries against the own keys (causal diagonal or full), run
            before the wait for the peers' blocks -- it hides their arrival;
    rest    every other (query block, key range) the mask keeps, one call per query block and
            contiguous key range: causal (i, [0, i)) full and (i, i) diagonal; without a mask
            (i, all keys) for a peer's block i, (me, keys before me) and (me, keys after me).

`rest` runs its blocks in an order that completes the peers' pieces first (a greedy pick: the
block that finishes most pieces headed to a peer, the cheaper on a tie) and hands each result
piece (result index, destination rank, tensor) to the caller the moment its last block is
done, so the all-to-all back sends it while the remaining blocks compute.  World 2, causal:
rank 0 computes (0,0) early, then (1,1) and (1,[0]) and sends rows 1 at the end; rank 1
computes (1,1) early, then (0,0) -- rows 0 go back at once -- and (1,[0]).  The backward's
pieces are dq per query block and dk, dv per key block: rank 0 sends dk1, dv1 after (1,1)
while (1,[0]) computes and dq1 at the end; rank 1 sends dq0 after (0,0) and dk0, dv0 at the end.

Partials merge by the LSE (merge.Accumulator: the first kept as the kernel gave it, the last
merge rounding once); gradient terms sum in the acc dtype (two terms: one fused add, fp32
math rounded once).  The forward's out and lse and the backward's sums are the ring's, so the
numerics are ring attention's.  Cost: 2n - 1 attention calls per causal pass instead of one,
and the merges and sums (measured against plain Ulysses by bench_attention, which times both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from torch_commopt.attention.local import acc_dtype, attend_bwd, attend_fwd
from torch_commopt.attention.merge import Accumulator

Piece = tuple[int, int, Tensor]  # (result index, destination rank, its token block of that result)


@dataclass(frozen=True)
class Block:
    """Query block `rows` against key blocks [keys[0], keys[1]) under `mask` ("full" or "causal")."""

    rows: int
    keys: tuple[int, int]
    mask: str

    def area(self) -> float:
        width = self.keys[1] - self.keys[0]
        return width / 2 if self.mask == "causal" else float(width)


def early_block(me: int, causal: bool) -> Block:
    return Block(me, (me, me + 1), "causal" if causal else "full")


def rest_blocks(me: int, n: int, causal: bool) -> list[Block]:
    """Every block but the early one, in query-block order (the module docstring)."""
    blocks = []
    for i in range(n):
        if causal:
            if i > 0:
                blocks.append(Block(i, (0, i), "full"))
            if i != me:
                blocks.append(Block(i, (i, i + 1), "causal"))
        elif i != me:
            blocks.append(Block(i, (0, n), "full"))
        else:
            blocks += [Block(i, keys, "full") for keys in ((0, me), (me + 1, n)) if keys[1] > keys[0]]
    return blocks


def _pieces_of(block: Block, backward: bool) -> list[tuple[str, int]]:
    """The result pieces a block adds to: ("q", query block) forward (out and lse), and in the
    backward also ("k", key block) for each key block it covers (dk and dv)."""
    own = [("q", block.rows)]
    return own + [("k", j) for j in range(*block.keys)] if backward else own


def order(me: int, n: int, causal: bool, backward: bool) -> list[tuple[Block, list[tuple[str, int]]]]:
    """rest_blocks in the order they run, each with the pieces it completes (early counted done
    first): greedily the block completing most pieces headed to a peer, then the smaller
    block, then query-block order."""
    pending = rest_blocks(me, n, causal)
    left: dict[tuple[str, int], int] = {}
    for block in [early_block(me, causal)] + pending:
        for piece in _pieces_of(block, backward):
            left[piece] = left.get(piece, 0) + 1
    for piece in _pieces_of(early_block(me, causal), backward):
        left[piece] -= 1
    plan = []
    while pending:
        def completes(block: Block) -> list[tuple[str, int]]:
            return [p for p in _pieces_of(block, backward) if left[p] == 1]

        def key(item: tuple[int, Block]):
            index, block = item
            return (-sum(p[1] != me for p in completes(block)), block.area(), index)
        index, block = min(enumerate(pending), key=key)
        done = completes(block)
        for piece in _pieces_of(block, backward):
            left[piece] -= 1
        plan.append((block, done))
        pending.pop(index)
    return plan


def early_pieces(me: int, n: int, causal: bool, backward: bool) -> list[tuple[str, int]]:
    """The pieces the early block alone completes (causal rank 0's own rows, forward)."""
    counts: dict[tuple[str, int], int] = {}
    for block in rest_blocks(me, n, causal):
        for piece in _pieces_of(block, backward):
            counts[piece] = counts.get(piece, 0) + 1
    return [p for p in _pieces_of(early_block(me, causal), backward) if p not in counts]


def _seq(x: Tensor, first: int, last: int, length: int) -> Tensor:
    return x[:, :, first * length:last * length]


def _dense(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.contiguous()


class Forward:
    """The staged compute of a forward (ce_a2a.pipelined / schedules._pipelined call early(g,
    own) then iterate rest(g, moved) per head group).  own: this rank's [B, h, L, D] pieces of
    q, k, v; moved: the [B, h, n L, D] q, k, v.  Yields lists of pieces (0: out in q's dtype,
    1: lse in the acc dtype); with kept_lse ((G, B, h, n L)) the lse goes there instead and only
    out is yielded (the training forward's kept lse)."""

    def __init__(self, *, me: int, n: int, causal: bool, scale: float, backend: str,
                 kept_lse: Optional[Tensor] = None) -> None:
        self.me, self.n, self.causal, self.scale, self.backend = me, n, causal, scale, backend
        self.kept_lse = kept_lse
        self.plan = order(me, n, causal, backward=False)
        self.accs: dict[int, Accumulator] = {}
        self.left: dict[int, int] = {}

    def _add(self, block: Block, q: Tensor, k: Tensor, v: Tensor) -> None:
        acc = self.accs.setdefault(block.rows, Accumulator(q, v.shape[-1], acc_dtype(q.dtype)))
        self.left[block.rows] -= 1
        acc.add(slice(None), *attend_fwd(q, k, v, scale=self.scale, mask=block.mask, backend=self.backend),
                last=self.left[block.rows] == 0)

    def _count(self) -> None:
        self.accs, self.left = {}, {}
        for block in [early_block(self.me, self.causal)] + [b for b, _ in self.plan]:
            self.left[block.rows] = self.left.get(block.rows, 0) + 1

    def early(self, g: int, own: Sequence[Tensor]) -> None:
        self._count()
        q, k, v = (_dense(x) for x in own[:3])
        self._add(early_block(self.me, self.causal), q, k, v)

    def _pieces(self, g: int, rows: int, dtype: torch.dtype) -> list[Piece]:
        out, lse = self.accs.pop(rows).result()
        out = out.to(dtype)
        if self.kept_lse is not None:
            _seq(self.kept_lse[g], rows, rows + 1, out.shape[2]).copy_(lse)
            return [(0, rows, out)]
        return [(0, rows, out), (1, rows, lse)]

    def rest(self, g: int, moved: Sequence[Tensor]) -> Iterator[list[Piece]]:
        q, k, v = moved[:3]
        length = q.shape[2] // self.n
        for rows in [p[1] for p in early_pieces(self.me, self.n, self.causal, backward=False)]:
            yield self._pieces(g, rows, q.dtype)
        for block, done in self.plan:
            self._add(block, _seq(q, block.rows, block.rows + 1, length), _seq(k, *block.keys, length),
                      _seq(v, *block.keys, length))
            if done:
                yield [p for _, rows in done for p in self._pieces(g, rows, q.dtype)]


class _Sum:
    """One gradient piece summed over its blocks' terms: the first kept as given, a second
    added in one fused op (fp32 math rounded once, or in the acc dtype), more in the acc dtype."""

    def __init__(self, terms: int, acc: torch.dtype) -> None:
        self.left, self.acc, self.total = terms, acc, None

    def add(self, term: Tensor) -> None:
        self.left -= 1
        if self.total is None:
            self.total = term
        elif self.left == 0 and self.total.dtype == term.dtype:
            self.total = torch.add(self.total, term)
        else:  # in place: a first term that is a view covers its own rows of a kernel output only
            self.total = (self.total if self.total.dtype == self.acc else self.total.to(self.acc)).add_(term)


class Backward:
    """The staged compute of a backward.  Without `kept`: own and moved are dout, q, k, v, out,
    lse (own [B, h, L, *] pieces, moved [B, h, n L, *]); with `kept` (the training forward's
    (G, ...) q, k, v, out, lse in this layout): dout alone.  Yields pieces 0: dq, 1: dk, 2: dv,
    typed as q, k, v."""

    def __init__(self, *, me: int, n: int, causal: bool, scale: float, backend: str,
                 kept: Optional[Sequence[Tensor]] = None) -> None:
        self.me, self.n, self.causal, self.scale, self.backend = me, n, causal, scale, backend
        self.kept = kept
        self.plan = order(me, n, causal, backward=True)

    def _inputs(self, g: int, given: Sequence[Tensor]) -> list[Tensor]:
        return [given[0]] + [t[g] for t in self.kept] if self.kept is not None else list(given)

    def early(self, g: int, own: Sequence[Tensor]) -> None:
        dout, q, k, v, out, lse = own if self.kept is None else (own[0], *self._own_kept(g))
        self.sums: dict[tuple[str, int], list[_Sum]] = {}
        counts: dict[tuple[str, int], int] = {}
        for block in [early_block(self.me, self.causal)] + [b for b, _ in self.plan]:
            for piece in _pieces_of(block, backward=True):
                counts[piece] = counts.get(piece, 0) + 1
        acc = acc_dtype(q.dtype)
        for piece, terms in counts.items():
            self.sums[piece] = [_Sum(terms, acc) for _ in range(1 if piece[0] == "q" else 2)]
        self._add(early_block(self.me, self.causal), *(_dense(x) for x in (dout, q, k, v, out, lse)))

    def _own_kept(self, g: int) -> list[Tensor]:
        length = self.kept[0].shape[3] // self.n
        return [_seq(t[g], self.me, self.me + 1, length) for t in self.kept]

    def _add(self, block: Block, dout, q, k, v, out, lse) -> None:
        dq, dk, dv = attend_bwd(dout, q, k, v, out, lse, scale=self.scale, mask=block.mask, backend=self.backend)
        self.sums[("q", block.rows)][0].add(dq)
        length = k.shape[2] // (block.keys[1] - block.keys[0])
        for j in range(*block.keys):
            part = j - block.keys[0]
            for total, grad in zip(self.sums[("k", j)], (dk, dv)):
                total.add(_seq(grad, part, part + 1, length))

    def _pieces(self, done: list[tuple[str, int]], dtypes: Sequence[torch.dtype]) -> list[Piece]:
        pieces = []
        for kind, index in done:
            sums = self.sums.pop((kind, index))
            slots = (0,) if kind == "q" else (1, 2)
            pieces += [(slot, index, total.total.to(dtypes[slot])) for slot, total in zip(slots, sums)]
        return pieces

    def rest(self, g: int, moved: Sequence[Tensor]) -> Iterator[list[Piece]]:
        dout, q, k, v, out, lse = self._inputs(g, moved)
        length = q.shape[2] // self.n
        dtypes = (q.dtype, k.dtype, v.dtype)
        first = early_pieces(self.me, self.n, self.causal, backward=True)
        if first:
            yield self._pieces(first, dtypes)
        for block, done in self.plan:
            rows = (block.rows, block.rows + 1)
            self._add(block, _seq(dout, *rows, length), _seq(q, *rows, length), _seq(k, *block.keys, length),
                      _seq(v, *block.keys, length), _seq(out, *rows, length), _dense(_seq(lse, *rows, length)))
            if done:
                yield self._pieces(done, dtypes)
