"""The sync_free schedule's own contract on gloo (its numerics against one process computing every
expert are in test_moe_schedules with every other schedule): a call past the capacity, or with a
rank's counts not adding up to its rows, marks its outputs NaN on every rank and makes check()
raise on every rank, with every rank running the same collectives; a right call after is right."""

from __future__ import annotations

import pytest
import torch
from moe_cases import run_sync_free_errors

from torch_commopt.kernels.moe import sync_free as sf
from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world", [2, 4])
def test_a_call_past_the_capacity_or_with_counts_off_is_nan_on_every_rank_and_check_raises(world):
    for got in run_distributed(run_sync_free_errors, world, backend="gloo", timeout_s=300):
        for case in ("over capacity", "counts off on the last rank"):
            nan, told, _, zero_grads = got[case]
            assert nan and "outputs were NaN on every rank" in told and zero_grads, (case, got[case])
        nan, told, err, zero_grads = got["right"]
        assert not nan and told == "" and err < 1e-12 and not zero_grads, got["right"]


def test_the_indices_pad_each_expert_s_group_as_by_expert_does():
    from torch_commopt.kernels.moe.by_expert import layout
    from torch_commopt.kernels.moe.exchange import Routing

    # 2 ranks, 2 local experts each; rank 0's view: rows from source p for its experts
    counts = torch.tensor([[3, 0, 2, 5], [9, 1, 0, 4]])  # [W, E]: rank p's rows per global expert
    place, ends, back = sf._expert_index(counts, 0, cap=12, align=8)
    recv = ((3, 0), (9, 1))
    _, padded, starts = layout(Routing(0, 2, send=((3, 0), (2, 5)), recv=recv), 8)
    assert ends.tolist() == [s + n for s, n in zip(starts, padded)]
    # expert 0: source 0's 3 rows (block 0, rows 0-2), then source 1's 9 (block 1, rows 12-20), 4 pads
    assert place[:16].tolist() == [0, 1, 2, *range(12, 21), 24, 24, 24, 24]
    # expert 1: source 1's one row (block 1, row 21), 7 pads; past the groups: nothing
    assert place[16:24].tolist() == [21] + [24] * 7 and set(place[24:].tolist()) == {24}
    # the outputs home: source 0's slots 0-2 from rows 0-2, source 1's 0-8 from 3-11 and 9 from 16
    rows = 2 * 12 + 2 * 8
    assert back[:12].tolist() == [0, 1, 2] + [rows] * 9
    assert back[12:].tolist() == [*range(3, 12), 16, rows, rows]


def test_refuses_counts_of_the_wrong_size():
    x, w = torch.zeros(4, 3), torch.zeros(2, 5, 3)

    class Group:
        group_name = "test"

    import torch.distributed as dist

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_world_size", lambda group=None: 2)
        mp.setattr(dist, "get_rank", lambda group=None: 0)
        with pytest.raises(ValueError, match="3 experts' counts for 2 local experts over 2 ranks"):
            sf.sync_free(x, torch.tensor([1, 2, 1]), (w, w.transpose(1, 2), w), Group())


@pytest.mark.parametrize("schedule", ["a2a", "by_expert"])
def test_a_module_captured_in_a_cuda_graph_runs_sync_free_sized_by_its_eager_calls(schedule):
    from moe_cases import run_capture_switch

    for got in run_distributed(run_capture_switch, 2, schedule, backend="gloo", timeout_s=300):
        assert "no capacity inside a CUDA-graph capture" in got["refused"], got  # before any eager call
        assert got["capacity"] == got["peak"], got  # the eager call's exchanged peak, no collective of its own
        assert got["last"] == "sync_free" and got["diff"] < 1e-12, got


@pytest.mark.parametrize("world", [2, 3])
def test_sync_free_equals_a2a_over_every_kind_of_routing(world):
    from moe_cases import run_sync_free_shapes

    for results in run_distributed(run_sync_free_shapes, world, backend="gloo", timeout_s=300):
        bad = [(case, err) for case, err in results if not err <= 1e-12]
        assert len(results) == 18 and not bad, bad
