"""The all-gather schedule's keys cut to the key blocks this rank's rows reach (TORCH_COMMOPT_FLEX_COMPACT_KEYS).

The all-gather schedule gives flex's kernels this rank's rows against every key of the sequence.
Under a document or window mask most key blocks hold none of the rows' tiles, and flex's backward
still runs a program for each of them (docs/flex-attention.md#measured).  Here the kernels get only
the key blocks some row of this rank keeps a tile of, in sequence order, gathered out of the
all-gathered K/V, and the mask of those keys: the block tables renumbered, and the mask function
given each compact key's position in the sequence through a buffer (`positions`), so that it
computes the same scores.  The backward's dK/dV of the compact keys are put back in place (zeros
elsewhere) before their reduce-scatter.

Nothing moves differently: every rank still gathers every key and reduce-scatters every gradient,
so the ranks need not agree on anything.  The compact width is rounded up to a multiple of an
eighth of the key blocks (padded with blocks no row reaches), so that new documents each batch
reuse one of at most eight compiled kernels per mask; where the rows reach more than three
quarters of the key blocks nothing is cut.  Finding the blocks costs one host read per mask
(cached with the schedule's cut, flex.cached).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torch_commopt.kernels.attention import flex

PARTS = 8  # compact widths are whole eighths of the key blocks: at most eight kernel shapes a mask
MAX_SHARE = 0.75  # cut only where at most this share of the key blocks remains


@dataclass(frozen=True)
class Compact:
    """The rows' mask against the compact keys, and where those keys are among all of them
    (`index`, int64 on the keys' device, block by block in sequence order)."""

    step: flex.Step
    index: Tensor


def reached(step: flex.Step) -> Tensor:
    """bool [key blocks]: the key blocks some row of `step` keeps a tile of (partial or full, any
    batch row or head)."""
    cols = step.tables[1] // step.tables[-2]
    used = torch.zeros(cols + 1, dtype=torch.bool, device=step.tables[2].device)  # a spare slot for the unused
    for num, idx in ((step.tables[2], step.tables[3]), (step.tables[4], step.tables[5])):
        if num is None:
            continue
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
        used[torch.where(valid, idx.long(), cols).flatten()] = True
    return used[:cols]


def width(used: int, cols: int) -> int | None:
    """The compact width in key blocks for `used` blocks reached of `cols`: rounded up to a whole
    PARTS-th of them; None where that leaves more than MAX_SHARE of them (no cut)."""
    quantum = max(1, cols // PARTS)
    wide = min(cols, -(-max(used, 1) // quantum) * quantum)
    return None if wide > MAX_SHARE * cols else wide


def compact(blocks: flex.Blocks, step: flex.Step) -> Compact | None:
    """The rows of `step` (flex.step_mask of one rank's rows against every key, s None) against
    the key blocks they reach, padded to `width`; None where no cut pays (one host read)."""
    block, cols = step.tables[-2], step.tables[1] // step.tables[-2]
    used = reached(step).cpu()
    count = int(used.sum())
    wide = width(count, cols)
    if wide is None:
        return None
    pad = wide - count
    if pad:
        used[(~used).nonzero().flatten()[:pad]] = True
    chosen = used.nonzero().flatten()  # [wide] key blocks, in sequence order
    renumber = torch.zeros(cols, dtype=torch.int64)
    renumber[chosen] = torch.arange(wide)
    index = (chosen[:, None] * block + torch.arange(block)).flatten()
    device = step.tables[2].device
    renumber, index = (_to(t, device) for t in (renumber, index))
    kn, ki, fn, fi = step.tables[2:6]
    cut = [renumber[i.long()][..., :wide].to(torch.int32).contiguous() if i is not None else None for i in (ki, fi)]
    tables = flex.kv_tables((kn, cut[0], fn, cut[1]), block, step.tables[0], wide * block)
    graph = blocks.graph

    def at_positions(b, h, q, kv, q_off, positions, *buffers):
        return graph(b, h, q + q_off, positions[kv], *buffers)

    positions = (index + step.buffers[1]).to(torch.int32)  # the keys' places in the sequence (step's offset 0)
    return Compact(flex.Step(tuple(tables) + (at_positions,), (step.buffers[0], positions, *step.buffers[2:]),
                             step.key + "\n# compact keys"), index)


def _to(t: Tensor, device: torch.device) -> Tensor:
    """t on `device`, through pinned memory where that is a GPU (a plain copy waits for the stream)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def keys_of(c: Compact | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The compact keys of [B, H, S, D] tensors of every key (c None: the tensors as they are)."""
    return tensors if c is None else tuple(t.index_select(2, c.index) for t in tensors)


def put_back(g: Tensor, c: Compact, length: int) -> Tensor:
    """The compact keys' gradient [B, H, n, D] in place among `length` keys (zeros elsewhere)."""
    out = g.new_zeros(g.shape[:2] + (length, g.shape[3]))
    return out.index_copy_(2, c.index, g)
