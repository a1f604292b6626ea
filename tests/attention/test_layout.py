"""layout.py: the factor algebra of reshapes, permutes and all-to-alls, checked against real
tensors moved the same way (a global tensor whose dim 0 is the rank)."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.passes.attention.layout import Atoms, Layout, relayout
from torch_commopt.passes.graph_utils import Unsupported


def _a2a(g: torch.Tensor) -> torch.Tensor:
    """all_to_all_single on dim 0 of every rank's tensor: rank p's chunk i <- rank i's chunk p."""
    w = g.shape[0]
    return g.view(w, w, g.shape[1] // w, *g.shape[2:]).transpose(0, 1).reshape(g.shape)


def _apply(how, x: torch.Tensor) -> torch.Tensor:
    return x.reshape(how.split).permute(how.order).reshape(how.shape)


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_moves_are_a_relayout_of_the_ranks_own_elements(world):
    b, s, h, d = 2, 3, 2 * world, 5
    g = torch.arange(world * b * s * h * d).view(world, b, s, h, d)  # rank r's (B, S_loc, H, D)
    atoms = Atoms()
    owner = atoms.new("R", world)
    lay = Layout.fresh(atoms, "x", (b, s, h, d), owner)
    # the program: split heads by rank, all-to-all, sequence = (source rank, position)
    lay = lay.regroup([b, s, world, h // world, d]).permute([2, 0, 1, 3, 4]).all_to_all(world)
    moved = _a2a(g.view(world, b, s, world, h // world, d).permute(0, 3, 1, 2, 4, 5).reshape(world, world * b,
                                                                                               s, h // world, d))
    lay = lay.permute([1, 0, 2, 3, 4]).regroup([b, world * s, h // world, d])
    moved = moved.view(world, world, b, s, h // world, d).transpose(1, 2).reshape(world, b, world * s, h // world, d)
    assert lay.shape() == list(moved.shape[1:])
    # sequence = (owner rank, position): rank-major; the head group is the new rank factor
    seq = atoms.leaves(lay.dims[1])
    assert seq[0] == "R" and atoms.leaves(lay.rank) != ["R"]
    # the op's layout for rank p: (B, H, S_loc, D) with H = (head-group rank, local head)
    target = [lay.dims[0], lay.rank + lay.dims[2], seq[1:], lay.dims[3]]
    how = relayout(atoms, ["x0", "x1", "x2", "x3"], target)  # rank p's input, as it was
    for p in range(world):
        canon = _apply(how, g[p])
        # the same elements the program's attention sees: head group r, positions of rank p
        for r in range(world):
            seen = moved[r].transpose(1, 2)[:, :, p * s:(p + 1) * s]  # (B, H/W, S_loc, D) on rank r
            assert torch.equal(canon[:, r * (h // world):(r + 1) * (h // world)], seen)


def test_reshape_that_cuts_a_dim_unevenly_is_unsupported():
    atoms = Atoms()
    lay = Layout.fresh(atoms, "x", (6, 4), atoms.new("R", 2))
    assert lay.regroup([2, 12]).shape() == [2, 12]  # 6 = 2 x 3: a clean cut
    with pytest.raises(Unsupported, match="splits a dim"):
        lay.regroup([4, 6])


def test_relayout_refuses_ends_holding_different_elements():
    atoms = Atoms()
    a = Layout.fresh(atoms, "a", (2, 3), [])
    b = Layout.fresh(atoms, "b", (3, 2), [])
    with pytest.raises(Unsupported, match="different elements"):
        relayout(atoms, [f for d in a.dims for f in d], b.dims)
    how = relayout(atoms, ["a0", "a1"], [["a1"], ["a0"]])
    x = torch.arange(6).view(2, 3)
    assert torch.equal(_apply(how, x), x.t())
