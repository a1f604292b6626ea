"""The ring plans (kernels/attention/ring.py) as pure functions: every causal (query, key) pair of the
global sequence is computed exactly once over all ranks and steps, and never a future one."""

from __future__ import annotations

import pytest

from torch_commopt.kernels.attention import comm
from torch_commopt.kernels.attention.ring import block_fractions, contiguous_plan, zigzag_plan, zigzag_q_plan


def _pairs(plan, n: int, length: int, q_chunks, k_chunks) -> list[tuple[int, int]]:
    """Global (query, key) positions a plan computes.  q_chunks(p, n) / k_chunks(s, n): the
    global chunks (of 2n, c = length/2 tokens each) that rank p's queries / rank s's keys hold."""
    c, seen = length // 2, []
    for p in range(n):
        for i in range(n):
            s = (p - i) % n
            qpos = [ch * c + j for ch in q_chunks(p, n) for j in range(c)]
            kpos = [ch * c + j for ch in k_chunks(s, n) for j in range(c)]
            for qs, ks, mask in plan(p, s, n, length):
                for a in range(length)[qs]:
                    for b in range(length)[ks]:
                        if mask == "causal" and b - ks.indices(length)[0] > a - qs.indices(length)[0]:
                            continue
                        seen.append((qpos[a], kpos[b]))
    return seen


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["contiguous", "zigzag", "zigzag_q"])
def test_a_causal_plan_computes_every_visible_pair_once(n, name):
    length = 4
    plan, qc, kc = {"contiguous": (contiguous_plan, comm.contiguous_chunks, comm.contiguous_chunks),
                    "zigzag": (zigzag_plan, comm.zigzag_chunks, comm.zigzag_chunks),
                    "zigzag_q": (zigzag_q_plan, comm.zigzag_chunks, comm.contiguous_chunks)}[name]
    seen = _pairs(plan(True), n, length, qc, kc)
    total = n * length
    assert sorted(seen) == [(a, b) for a in range(total) for b in range(a + 1)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_zigzag_queries_balance_every_rank(n):
    fractions = block_fractions(zigzag_q_plan(True), n)
    assert all(sum(row) == pytest.approx(n / 2) for row in fractions)  # the average: n^2 / 2 blocks over n ranks
    if n == 2:  # single steps are not balanced (the cost model charges them as they are)
        assert fractions == [[0.625, 0.375], [0.125, 0.875]]
    contiguous = block_fractions(contiguous_plan(True), n)
    assert max(sum(r) for r in contiguous) == n - 0.5
