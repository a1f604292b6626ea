"""Layout.mask_mod's folded gathers (kernels/attention/mask_fold.py): the folded mask equals the
composed one everywhere, reads each tensor at a layout position in one gather, and masks it cannot
fold or trace keep the composed form."""

from __future__ import annotations

import torch

from torch_commopt.kernels.attention import balance, flex
from torch_commopt.kernels.attention.mask_fold import over_positions

S, BLOCK = 512, 64
ZERO = torch.zeros((), dtype=torch.int64)


def _layout(seed: int) -> balance.Layout:
    order = torch.randperm(S // BLOCK, generator=torch.Generator().manual_seed(seed))
    return balance.Layout(order, BLOCK, 2, "by_work")


def _grid(mask) -> torch.Tensor:
    return mask(ZERO, ZERO, torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1))


def _nested_gathers(mask) -> int:
    """Gathers whose index is itself a gather's result, in the mask's traced graph."""
    gm, _ = flex.lift(mask, torch.device("cpu"))
    index = torch.ops.aten.index.Tensor
    return sum(1 for n in gm.graph.nodes if n.target is index and isinstance(n.args[1][0], torch.fx.Node)
               and n.args[1][0].target is index)


def test_a_document_mask_over_a_layout_reads_the_layout_s_ids_in_one_gather():
    gen = torch.Generator().manual_seed(1)
    ids = torch.repeat_interleave(torch.arange(6), torch.tensor([90, 60, 120, 80, 100, 62]))
    window = torch.randint(16, 200, (S,), generator=gen)  # a per-position window length
    masks = {"documents": lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv),
             "window table": lambda b, h, q, kv: (q >= kv) & (q - kv < window[q]),
             "documents + window": lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv) & (q - kv < window[kv])}
    for seed in range(3):
        lay = _layout(seed)
        pos = lay.positions()
        for name, mod in masks.items():
            composed = lambda b, h, q, kv, mod=mod: mod(b, h, pos[q], pos[kv])  # noqa: E731
            folded = lay.mask_mod(mod)
            assert torch.equal(_grid(folded), _grid(composed)), (name, seed)
            assert _nested_gathers(composed) > 0 and _nested_gathers(folded) == 0, name


def test_masks_it_cannot_fold_or_trace_keep_their_composed_form():
    lay = _layout(4)
    pos = lay.positions()
    table = torch.arange(S // BLOCK) % 3  # read per block of positions: q // BLOCK is no layout position
    ids2 = torch.arange(2 * S).view(2, S) // 100  # read at (b, position): two indices

    def untraceable(b, h, q, kv):  # leaves torch: make_fx cannot follow it
        return torch.from_numpy(q.numpy() >= kv.numpy())

    cases = {"causal": lambda b, h, q, kv: q >= kv, "per block": lambda b, h, q, kv: table[q // BLOCK] == table[kv // BLOCK],
             "two indices": lambda b, h, q, kv: ids2[b, q] == ids2[b, kv], "untraceable": untraceable}
    for name, mod in cases.items():
        folded = over_positions(mod, pos)
        want = mod(ZERO, ZERO, pos[torch.arange(S).view(-1, 1)], pos[torch.arange(S).view(1, -1)])
        assert torch.equal(_grid(folded), want), name
        assert folded.__name__ == "composed", name  # nothing folded: the composed mask itself


def test_the_folded_mask_s_trace_is_the_one_the_schedules_take(monkeypatch):
    """lay.mask_mod traces once: flex.lifted_mask answers the folded mask from that trace (the
    schedules would otherwise trace it again, ~10 ms of host time a new mask)."""
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 200, 112, 100]))
    folded = _layout(5).mask_mod(lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv))

    def no_trace(*args):
        raise AssertionError("traced again")

    monkeypatch.setattr(flex, "lift", no_trace)  # a second trace would fail the test
    gm, buffers = flex.lifted_mask(folded, torch.device("cpu"))
    assert torch.equal(gm(ZERO, ZERO, torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1), *buffers),
                       _grid(folded))
