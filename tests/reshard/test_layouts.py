"""The layout algebra: which collective moves a tensor between two layouts, and its price."""

from __future__ import annotations

import pytest

from torch_commopt.reshard.layouts import Partial, Replicate, Shard, reshard, reshard_kind
from torch_commopt.tuner.calibration import prior

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial("sum")


@pytest.mark.parametrize("src, dst, kind", [
    (S0, S0, "none"), (R, R, "none"), (P, P, "none"),
    (R, S0, "slice"), (S0, R, "all_gather"), (S0, S1, "all_to_all"),
    (P, R, "all_reduce"), (P, S1, "reduce_scatter"),
])
def test_reshard_kind_names_the_collective(src, dst, kind):
    assert reshard_kind(src, dst) == kind


@pytest.mark.parametrize("src", [S0, R, Partial("avg")])
def test_nothing_produces_a_partial_and_only_sums_are_reduced(src):
    with pytest.raises(ValueError):
        reshard_kind(src, P)
    with pytest.raises(ValueError):
        reshard_kind(Partial("max"), R)


def test_reshard_prices_time_and_memory_from_the_calibration():
    cal, mib = prior("cpu", 4), 2.0**20
    ag = reshard(S0, R, 64 * mib, 4, cal)
    ar = reshard(P, R, 64 * mib, 4, cal)
    rs = reshard(P, S0, 64 * mib, 4, cal)
    a2a = reshard(S0, S1, 64 * mib, 4, cal)
    assert ag.memory == ar.memory == 64 * mib  # the destination holds the whole tensor
    assert rs.memory == a2a.memory == 16 * mib  # one shard
    assert min(ag.time, ar.time, rs.time, a2a.time) > 0
    assert ar.time > rs.time  # an all-reduce is a reduce-scatter and an all-gather
    assert reshard(S0, R, 128 * mib, 4, cal).time > ag.time  # more bytes take longer
    assert a2a.time < ag.time  # each rank sends 1/W of its shard to each peer, not all of it
    for free in (reshard(R, S0, 64 * mib, 4, cal), reshard(S0, S0, 64 * mib, 4, cal), reshard(S0, R, 64 * mib, 1, cal)):
        assert free.time == 0 and free.memory == 0, free
    assert str(ag) == "S(0)->R (all_gather)"
