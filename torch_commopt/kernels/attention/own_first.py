"""Ulysses whose forward attention starts on the rank's own block (schedule `ulysses:early`).

After Ulysses's all-to-all a rank holds h = H/n heads over the whole sequence, n blocks of
L = S_loc tokens in rank order; block `me` is its own and needs no transfer.  Plain Ulysses
waits for every block, runs one attention over n*L tokens and sends every result back after
it, so each pass exposes its inputs' and its results' transfers (16K tokens, MHA: ~1 ms of
an 8 ms training call; docs/context-parallel-attention.md).  Here the forward attention
is cut into blocks (query block i, a range of key blocks, a mask):

    early   (me, me): the own queries against the own keys (causal diagonal or full), queued
            before the wait for the peers' blocks -- it hides their arrival;
    rest    every other (query block, key range) the mask keeps, one call per query block and
            contiguous key range: causal (i, [0, i)) full and (i, i) diagonal; without a mask
            (i, all keys) for a peer's block i, (me, keys before me) and (me, keys after me).

`rest` runs its blocks in an order that completes the peers' pieces first (greedily the block
that finishes most pieces headed to a peer, the cheaper on a tie) and hands each result piece
(result index, destination rank, tensor) over the moment its last block is done, so the
all-to-all back sends it while the remaining blocks compute.  World 2, causal: rank 0 computes
(0,0) early, then (1,1) and (1,[0]) and sends rows 1 at the end; rank 1 computes (1,1) early,
then (0,0) -- rows 0 go back at once -- and (1,[0]).  Partials merge by the LSE
(merge.Accumulator: the first kept as the kernel gave it, the last merge rounding once), as
ring attention's do: the numerics are the ring's.

The backward stays plain Ulysses's single call.  Split the same way (dq per query block, dk /
dv per key block, summed in the acc dtype, each piece sent once final) it costs more than the
~0.4 ms of transfers it would hide (B1 H32 D128, 16K tokens, causal: cuDNN's backward over the
three blocks takes ~0.45 ms a call more than in one, its per-call dO.O and dq passes 0.1 ms
more, the sums 0.1 ms).  The forward's split costs ~0.1 ms of kernels and ~0.05 ms of merges,
about what the own block hides: ulysses:early runs 1-4% behind ulysses:g=1, and the
two-group ulysses ahead of both (docs/context-parallel-attention.md).  So the schedule runs
where named (a machine whose link is slow against its attention may gain) and is not among the
cost model's candidates (cost.candidates).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from torch_commopt.kernels.attention.local import acc_dtype, attend_fwd
from torch_commopt.kernels.attention.merge import Accumulator

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


def order(me: int, n: int, causal: bool) -> list[tuple[Block, list[int]]]:
    """rest_blocks in the order they run, each with the query blocks whose rows it completes
    (the early block counted done first): greedily the block completing rows headed to a peer,
    then the smaller block, then query-block order."""
    pending = rest_blocks(me, n, causal)
    left = {i: sum(b.rows == i for b in pending) for i in range(n)}
    plan = []
    while pending:
        def key(item: tuple[int, Block]):
            index, block = item
            return (-(left[block.rows] == 1 and block.rows != me), block.area(), index)
        index, block = min(enumerate(pending), key=key)
        left[block.rows] -= 1
        plan.append((block, [block.rows] if left[block.rows] == 0 else []))
        pending.pop(index)
    return plan


def early_rows(me: int, n: int, causal: bool) -> list[int]:
    """The query blocks the early block alone completes (causal rank 0's own rows)."""
    return [] if any(b.rows == me for b in rest_blocks(me, n, causal)) else [me]


def _seq(x: Tensor, first: int, last: int, length: int) -> Tensor:
    return x[:, :, first * length:last * length]


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
        self.plan = order(me, n, causal)
        self.first = early_rows(me, n, causal)
        self.blocks_per_rows: dict[int, int] = {}  # query block -> its blocks (the early one included)
        for block in [early_block(me, causal)] + [b for b, _ in self.plan]:
            self.blocks_per_rows[block.rows] = self.blocks_per_rows.get(block.rows, 0) + 1
        self.accs: dict[int, Accumulator] = {}
        self.left: dict[int, int] = {}

    def _add(self, block: Block, q: Tensor, k: Tensor, v: Tensor) -> None:
        acc = self.accs.setdefault(block.rows, Accumulator(q, v.shape[-1], acc_dtype(q.dtype)))
        self.left[block.rows] -= 1
        acc.add(slice(None), *attend_fwd(q, k, v, scale=self.scale, mask=block.mask, backend=self.backend),
                last=self.left[block.rows] == 0)

    def early(self, g: int, own: Sequence[Tensor]) -> None:
        self.accs, self.left = {}, dict(self.blocks_per_rows)
        q, k, v = own[:3]  # head slices of the caller's tensors: rows contiguous, as the kernels take them
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
        for rows in self.first:
            yield self._pieces(g, rows, q.dtype)
        for block, done in self.plan:
            self._add(block, _seq(q, block.rows, block.rows + 1, length), _seq(k, *block.keys, length),
                      _seq(v, *block.keys, length))
            for rows in done:
                yield self._pieces(g, rows, q.dtype)
