"""ulysses:early's block plan (kernels/attention/own_first.py): the early block and the rest cover
exactly the attention the mask keeps, every query block completes once, and the peers' rows
complete before the rank's own wherever the plan can order them so (numerics against full
attention: cp_programs' every-schedule cases; the all-to-all protocol: test_protocol_sim)."""

from __future__ import annotations

import pytest

from torch_commopt.kernels.attention import own_first


def _cells(blocks, n: int) -> list[tuple[int, int, str]]:
    """(query block, key block, mask) cells the blocks compute."""
    cells = []
    for b in blocks:
        for j in range(*b.keys):
            cells.append((b.rows, j, b.mask))
    return cells


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_blocks_cover_what_the_mask_keeps_once(n, causal):
    for me in range(n):
        blocks = [own_first.early_block(me, causal)] + [b for b, _ in own_first.order(me, n, causal)]
        got = sorted(_cells(blocks, n))
        want = sorted((i, j, "causal" if causal and i == j else "full")
                      for i in range(n) for j in range(n) if not causal or j <= i)
        assert got == want, (me, got)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_every_query_block_completes_once_and_the_peers_first_where_they_can(n, causal):
    for me in range(n):
        plan = own_first.order(me, n, causal)
        done = own_first.early_rows(me, n, causal) + [i for _, rows in plan for i in rows]
        assert sorted(done) == list(range(n))
        # a block completes its rows only once no later block reads them
        for k, (block, rows) in enumerate(plan):
            assert rows in ([], [block.rows])
            later = [b.rows for b, _ in plan[k + 1:]]
            assert bool(rows) == (block.rows not in later)
        own_done = done.index(me)
        if any(b.rows == me for b, _ in plan):  # the own rows wait for peers' keys: they finish last
            assert own_done == n - 1, (me, done)


def test_world_two_causal_runs_as_the_docstring_says():
    assert [(b.rows, b.keys, b.mask, rows) for b, rows in own_first.order(0, 2, True)] == \
        [(1, (1, 2), "causal", []), (1, (0, 1), "full", [1])]
    assert [(b.rows, b.keys, b.mask, rows) for b, rows in own_first.order(1, 2, True)] == \
        [(0, (0, 1), "causal", [0]), (1, (0, 1), "full", [1])]
    assert own_first.early_rows(0, 2, True) == [0] and own_first.early_rows(1, 2, True) == []
