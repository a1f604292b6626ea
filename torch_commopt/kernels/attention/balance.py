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
        """mask_mod(b, h, q, kv) of sequence positions, stated over layout positions: what it reads
        at a position (document ids, a window table) read through the layout's positions once,
        here (mask_fold.over_positions), so the kernels load it in one step; the mask describes
        those tensors as they are now, like the block mask built from it."""
        from torch_commopt.kernels.attention.mask_fold import over_positions

        return over_positions(mask_mod, self.positions(device))

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
