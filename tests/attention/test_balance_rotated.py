"""balance.tile_matrix and the two-rank `rotated` layout: its run placed where the ranks' tiles
balance, the fewest tiles crossing; the schedules on it, and what the ring's cut sends move."""

from __future__ import annotations

import pytest
import torch
from flex_programs import BLOCK, S, doc_ids, mask_mod_of, run_flex_ring

from torch_commopt.testing.launch import run_distributed


def _documents(seq: int, seed: int):
    """A mask of causal documents of 100..700 tokens over seq tokens (boundaries inside blocks)."""
    gen, ids, pos = torch.Generator().manual_seed(seed), torch.zeros(seq, dtype=torch.int32), 0
    while pos < seq:
        pos += int(torch.randint(100, 701, (1,), generator=gen))
        ids[pos:] += 1
    return lambda b, h, q, kv: (ids[q] == ids[kv]) & (q >= kv)


def test_the_tile_matrix_adds_up_to_the_rows_and_the_ranks_work():
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import balance, flex

    mask = create_block_mask(mask_mod_of("document", doc_ids(2)), 2, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    tiles = balance.tile_matrix(mask)
    assert torch.equal(tiles.sum(1), balance.row_work(mask))
    n, work = tiles.shape[0], flex.work(flex.Blocks.of(mask), 2)
    for p in range(2):
        for s in range(2):
            assert int(tiles[p * n // 2:(p + 1) * n // 2, s * n // 2:(s + 1) * n // 2].sum()) == int(work[p, s])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotated_takes_the_most_balanced_start_then_the_fewest_crossing_tiles(seed):
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import balance

    seq = 8192
    mask = create_block_mask(_documents(seq, seed), None, None, seq, seq, device="cpu", BLOCK_SIZE=BLOCK)
    tiles, rows = balance.tile_matrix(mask), balance.row_work(mask)
    lay = balance.rotated(tiles, BLOCK)
    n, half = tiles.shape[0], tiles.shape[0] // 2
    assert lay.name == "rotated" and lay.world == 2

    def brute(c):  # (busiest rank's tiles, tiles joining the ranks) with rank 1 on [c, c + half)
        mine = torch.zeros(n, dtype=torch.bool)
        mine[c:c + half] = True
        ones = int(rows[mine].sum())
        return max(ones, int(rows.sum()) - ones), int(tiles[mine][:, ~mine].sum() + tiles[~mine][:, mine].sum())

    best = min(range(half + 1), key=lambda c: (*brute(c), c))
    assert torch.equal(lay.order[half:], torch.arange(best, best + half))  # rank 1's run
    assert torch.equal(lay.order[:half], torch.cat([torch.arange(best), torch.arange(best + half, n)]))
    assert max(lay.rank_work(rows)) == brute(best)[0] <= max(balance.contiguous(n, 2, BLOCK).rank_work(rows))
    by_work = balance.by_work(rows, 2, BLOCK)
    crossing = lambda lay: int(tiles[lay.order[:half]][:, lay.order[half:]].sum()  # noqa: E731
                               + tiles[lay.order[half:]][:, lay.order[:half]].sum())
    assert crossing(lay) == brute(best)[1] < crossing(by_work) / 4  # documents stay whole but at the run's ends
    assert max(lay.rank_work(rows)) <= max(by_work.rank_work(rows)) + int(rows.max())


def test_rotated_refuses_an_odd_number_of_blocks():
    from torch_commopt.kernels.attention import balance

    with pytest.raises(ValueError, match="do not split over 2 ranks"):
        balance.rotated(torch.ones(3, 3, dtype=torch.int64), BLOCK)


@pytest.mark.parametrize("schedule", ["ring", "allgather"])
def test_the_schedules_run_on_the_rotated_layout(schedule):
    """Dense attention and its gradients on the rotated layout (the whole mask on every rank);
    the ring's cut sends move only the spans around the run's ends, fewer rows than on
    choose's layout (by_work for documents), whose scattered blocks need most of each other's keys."""
    rotated = run_distributed(run_flex_ring, 2, "document", 2, schedule, False, "rotated", backend="gloo",
                              timeout_s=300)
    for rank, got in enumerate(rotated):
        assert got["layout"] == "rotated", got
        assert all(e < 1e-10 for e in got["errors"].values()), (rank, got["errors"])
    if schedule == "ring":
        dealt = run_distributed(run_flex_ring, 2, "document", 2, "ring", False, "choose", backend="gloo",
                                timeout_s=300)
        assert dealt[0]["layout"] == "by_work"
        sent = [sum(g["sent_numel"] for g in run) for run in (rotated, dealt)]
        assert sent[0] < sent[1], sent
