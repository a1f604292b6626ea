"""Sequence layouts that balance a mask's work over the ranks of a context-parallel group.

A rank's work in masked attention is the number of tiles (block x block score tiles with a kept
score) in its rows.  Over contiguous shares a causal mask gives the last rank 2W - 1 times the
first's; documents and windows give whatever their positions give.  The slowest rank sets a
step's time, so the tokens should be dealt out by work before the model sees them, as torch's
context_parallel does with its load balancers.

A Layout deals whole blocks of the sequence: rank p holds blocks `order[p*n:(p+1)*n]` (n = blocks
per rank), in that order.  Whole blocks keep the mask's tile structure: tile (i, j) of the
sequence is tile (i', j') of the layout, so a rank's tiles are the sum of its blocks' rows.  The
program then works in layout order:
- `shard(x, dim, rank)` gives a rank its tokens (inputs, labels, positions for RoPE);
- `mask_mod(mask_mod)` states the mask over layout positions (the positions are a buffer of the
  mask, so a new layout each batch recompiles nothing);
- `restore(x, dim)` puts a whole layout-ordered sequence back in order.
K/V all-gathered along the sequence arrive in layout order, the order the mask is stated in, so
every commopt flex schedule runs on any layout unchanged.

Layouts: `contiguous`; `head_tail` (rank p holds chunks p and 2W - 1 - p: the zigzag that balances
a causal mask); `by_work` (blocks dealt greedily, heaviest first, to the least loaded rank with
room: balances any mask within one block's work).  `choose` takes the layout whose busiest rank
has the fewest tiles -- the time every schedule's compute is bound by (the all-gather's transfers
do not depend on the layout) -- preferring the simpler layout on a tie.

`rotated` (two ranks): rank 1 holds one run of half the blocks, rank 0 the rest (the blocks
before the run and after it), the run placed where the two ranks' tiles balance best and, among
those places, where the fewest tiles join a rank's rows to the other's keys.  It balances work as
`by_work` does on documents and windows, but only the tiles around the run's two ends cross
ranks, and a rank's rows reach one short span of the other's keys: what the ring needs moved
where its sends are cut (flex_ring.skipping), where `by_work`'s scattered blocks reach nearly all
of them.  Not among `choose`'s candidates: the all-gather moves every key whatever the layout.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Layout:
    """order: the sequence's block indices in layout order (int64, W * n of them); block: tokens
    a block; world: ranks; name: the layout's kind."""

    order: Tensor
    block: int
    world: int
    name: str = "custom"

    def __post_init__(self) -> None:
        nb = self.order.numel()
        if nb % self.world or not torch.equal(torch.sort(self.order.cpu()).values, torch.arange(nb)):
            raise ValueError(f"balance.Layout: {nb} blocks over {self.world} ranks are not a permutation of whole "
                             "shares")

    def positions(self, device=None) -> Tensor:
        """The sequence position of each layout position (int64 [S])."""
        offsets = torch.arange(self.block, device=self.order.device)
        return (self.order[:, None] * self.block + offsets).flatten().to(device or self.order.device)

    def rearrange(self, x: Tensor, dim: int) -> Tensor:
        """The whole sequence x (along dim) in layout order."""
        return x.index_select(dim, self.positions(x.device))

    def shard(self, x: Tensor, dim: int, rank: int) -> Tensor:
        """Rank `rank`'s tokens of the whole sequence x (along dim), in layout order."""
        share = x.shape[dim] // self.world
        return self.rearrange(x, dim).narrow(dim, rank * share, share)

    def restore(self, x: Tensor, dim: int) -> Tensor:
        """A whole layout-ordered sequence x (along dim) back in sequence order."""
        return x.index_select(dim, torch.argsort(self.positions(x.device)))

    def mask_mod(self, mask_mod, device=None):
        """mask_mod(b, h, q, kv) of sequence positions, stated over layout positions."""
        pos = self.positions(device)
        return lambda b, h, q, kv: mask_mod(b, h, pos[q], pos[kv])

    def rank_work(self, rows: Tensor) -> list[int]:
        """Each rank's tiles, from the tiles of every row block of the sequence (row_work)."""
        per = rows.to(torch.int64).cpu()[self.order.cpu()].view(self.world, -1).sum(1)
        return per.tolist()


def row_work(block_mask) -> Tensor:
    """The tiles of each row block of a whole-sequence BlockMask (summed over batch and heads): int64 [blocks]."""
    tiles = block_mask.kv_num_blocks.to(torch.int64)
    if block_mask.full_kv_num_blocks is not None:
        tiles = tiles + block_mask.full_kv_num_blocks
    return tiles.flatten(0, -2).sum(0)


def contiguous(blocks: int, world: int, block: int) -> Layout:
    return Layout(torch.arange(blocks), block, world, "contiguous")


def head_tail(blocks: int, world: int, block: int) -> Layout:
    """Rank p: chunk p and chunk 2W - 1 - p of 2W equal chunks (needs blocks divisible by 2W)."""
    if blocks % (2 * world):
        raise ValueError(f"balance.head_tail: {blocks} blocks do not split into {2 * world} chunks")
    chunk = blocks // (2 * world)
    chunks = torch.arange(blocks).view(2 * world, chunk)
    return Layout(torch.cat([torch.cat([chunks[p], chunks[2 * world - 1 - p]]) for p in range(world)]), block, world,
                  "head_tail")


def by_work(rows: Tensor, world: int, block: int) -> Layout:
    """Blocks dealt heaviest first to the rank with the fewest tiles that has room (a share of
    blocks / world blocks each); each rank's blocks in sequence order."""
    work = rows.to(torch.int64).cpu().tolist()
    share = len(work) // world
    if share * world != len(work):
        raise ValueError(f"balance.by_work: {len(work)} blocks do not split over {world} ranks")
    held: list[list[int]] = [[] for _ in range(world)]
    heap = [(0, p) for p in range(world)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        load, p = heapq.heappop(heap)
        held[p].append(i)
        if len(held[p]) < share:
            heapq.heappush(heap, (load + work[i], p))
    return Layout(torch.tensor([i for blocks in held for i in sorted(blocks)]), block, world, "by_work")


def tile_matrix(block_mask) -> Tensor:
    """int64 [n, n]: the tiles of row block i against key block j of a whole-sequence BlockMask
    (partial and full blocks, summed over batch and heads)."""
    n = block_mask.kv_num_blocks.shape[-1]
    out = torch.zeros(n * n, dtype=torch.int64)
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            continue
        idx = idx.cpu().to(torch.int64).flatten(0, -3)  # [B * H, n, columns]
        valid = torch.arange(idx.shape[-1]) < num.cpu().to(torch.int64).flatten(0, -2)[..., None]
        cells = torch.arange(n)[:, None] * n + idx
        out += torch.bincount(cells[valid], minlength=n * n)
    return out.view(n, n)


def rotated(tiles: Tensor, block: int) -> Layout:
    """Two ranks: rank 1 holds blocks [c, c + n / 2), rank 0 the others in sequence order, c the
    start whose busiest rank has the fewest tiles, then the fewest tiles between the ranks, then
    the earliest (tiles: tile_matrix's [n, n])."""
    n = tiles.shape[0]
    if n % 2:
        raise ValueError(f"balance.rotated: {n} blocks do not split over 2 ranks")
    half, t = n // 2, tiles.to(torch.int64).cpu()
    rows, cols = (torch.cat([torch.zeros(1, dtype=torch.int64), t.sum(d).cumsum(0)]) for d in (1, 0))
    square = torch.zeros(n + 1, n + 1, dtype=torch.int64)
    square[1:, 1:] = t.cumsum(0).cumsum(1)
    starts = torch.arange(half + 1)
    ends = starts + half
    run_rows, run_cols = rows[ends] - rows[starts], cols[ends] - cols[starts]
    inside = square[ends, ends] - square[starts, ends] - square[ends, starts] + square[starts, starts]
    busiest = torch.maximum(run_rows, rows[-1] - run_rows)
    crossing = run_rows + run_cols - 2 * inside  # tiles of the run's rows outside it, and of its keys' other rows
    c = min(range(half + 1), key=lambda i: (int(busiest[i]), int(crossing[i]), i))
    mine = torch.zeros(n, dtype=torch.bool)
    mine[c:c + half] = True
    order = torch.cat([torch.arange(n)[~mine], torch.arange(n)[mine]])
    return Layout(order, block, 2, "rotated")


def candidates(rows: Tensor, world: int, block: int) -> list[Layout]:
    """contiguous, head_tail (where the blocks split into 2W chunks) and by_work, in that order."""
    n = rows.numel()
    out = [contiguous(n, world, block)]
    if n % (2 * world) == 0:
        out.append(head_tail(n, world, block))
    return out + [by_work(rows, world, block)]


def choose(block_mask, world: int) -> Layout:
    """The layout whose busiest rank has the fewest tiles (ties: the earlier of contiguous,
    head_tail, by_work) for a whole-sequence BlockMask."""
    rows = row_work(block_mask)
    bq, bk = block_mask.BLOCK_SIZE
    if bq != bk:
        raise ValueError(f"balance.choose: Q and KV blocks of one size, got {bq} and {bk}")
    layouts = candidates(rows, world, bq)
    return min(layouts, key=lambda lay: max(lay.rank_work(rows)))  # min keeps the first of equals
