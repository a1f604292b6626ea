"""A symmetric allocation that fails on one rank fails on every rank together (no rank is left
in the collective rendezvous), and the size class is refused afterwards without a vote."""

from __future__ import annotations

import pytest
from symm_vote_programs import vote_sequence

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world", [2, 3])
def test_an_allocation_failing_on_one_rank_is_refused_on_every_rank(world):
    for rank, (outcomes, tried, refused, events) in enumerate(run_distributed(vote_sequence, world)):
        assert outcomes[0] == "ok 32 MiB, handle" and outcomes[3] == "ok 16 MiB, handle", outcomes
        assert outcomes[1].startswith("refused") and f"rank {world - 1}" in outcomes[1], outcomes[1]
        assert "out of memory" in outcomes[1].lower() or "OutOfMemoryError" in outcomes[1], outcomes[1]
        assert outcomes[2].startswith("refused") and "64 MiB already failed" in outcomes[2], outcomes[2]
        assert tried == [32, 64, 16] and refused == 64, (rank, tried)  # 128 MiB: not even tried
        # a buffer is written and settled here before the rendezvous lets a peer write it
        assert events == ["settle 32", "rendezvous 32", "settle 16", "rendezvous 16"], (rank, events)
