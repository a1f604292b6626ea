"""Expert-parallel schedules (kernels/moe) on gloo at 2 and 4 ranks: outputs, input gradients and
the local experts' weight gradients against one process computing every expert over every rank's
tokens, for balanced routing and for skewed routing (an empty expert, a rank whose experts receive
nothing, a rank that routes no tokens)."""

from __future__ import annotations

import pytest
import torch
from moe_cases import CASES, run_install, run_schedules

from torch_commopt.kernels.moe.exchange import Routing
from torch_commopt.kernels.moe.module import install
from torch_commopt.kernels.moe.schedules import expert_major, expert_parallel
from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_one_process_computing_every_expert(world):
    for results in run_distributed(run_schedules, world, backend="gloo", timeout_s=300):
        assert len(results) == 2 * len(CASES)
        bad = [(case, err) for case, err in results if not err <= 1e-12]  # float64: only the order of sums moves
        assert not bad, bad


def test_transfers_staged_through_host_memory_match_too():
    # gloo moves no CUDA tensor: ranks sharing one GPU stage every transfer through host buffers
    for results in run_distributed(run_schedules, 2, ("skewed",), "cpu", True, backend="gloo", timeout_s=300):
        assert len(results) == len(CASES) and all(err <= 1e-12 for _, err in results), results


def test_expert_major_order_interleaves_the_sources_per_expert():
    # 2 sources, 2 local experts: source 0 sent (2, 1) rows, source 1 sent (0, 3)
    routing = Routing(0, 2, send=((2, 1), (0, 3)), recv=((2, 1), (0, 3)))
    # source-major rows: s0e0: 0,1  s0e1: 2  s1e1: 3,4,5 -> expert 0 first, then expert 1's of both sources
    assert expert_major(routing).tolist() == [0, 1, 2, 3, 4, 5]
    routing = Routing(0, 2, send=((1, 1), (1, 1)), recv=((1, 2), (3, 0)))
    # s0e0: 0  s0e1: 1,2  s1e0: 3,4,5 -> e0: 0,3,4,5  e1: 1,2
    assert expert_major(routing).tolist() == [0, 3, 4, 5, 1, 2]
    assert routing.per_expert() == (4, 2) and routing.send_offset(1) == 2


def test_bad_calls_are_refused_with_the_reason():
    x = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="unknown expert-parallel schedule 'ring'"):
        expert_parallel(x, torch.tensor([3]), lambda r, c: r, None, "ring")
    for bad in ("by_expert:0", "by_expert:x", "a2a:2"):
        with pytest.raises(ValueError, match="malformed expert-parallel schedule"):
            expert_parallel(x, torch.tensor([3]), lambda r, c: r, None, bad)
    with pytest.raises(ValueError, match="by_expert runs the experts' SwiGLU itself and needs their weights"):
        expert_parallel(x, torch.tensor([3]), lambda r, c: r, None, "by_expert")
    routing = Routing(0, 1, send=((2,),), recv=((2,),))
    with pytest.raises(ValueError, match="sum to 2 tokens, x has 3 rows"):
        expert_parallel(x, torch.tensor([2]), lambda r, c: r, None, "a2a", routing=routing)


@pytest.mark.parametrize("schedule", ["by_peer", "by_expert"])
def test_install_makes_a_plain_grouped_experts_module_expert_parallel(schedule):
    assert run_distributed(run_install, 2, schedule, backend="gloo", timeout_s=300) == [0.0, 0.0]


def test_install_refuses_what_it_cannot_run():
    with pytest.raises(TypeError, match="no GroupedExperts weights"):
        install(torch.nn.Linear(2, 2), None, "a2a")
    experts = torch.nn.Module()
    experts.w1, experts.w2, experts.w3 = (torch.nn.Parameter(torch.zeros(s)) for s in ((2, 3, 4), (2, 4, 3), (2, 3, 4)))
    with pytest.raises(ValueError, match="unknown expert-parallel schedule 'ring'"):
        install(experts, None, "ring")
    with pytest.raises(ValueError, match="schedule 'auto' needs a chooser"):
        install(experts, None, "auto")
    with pytest.raises(ValueError, match="'auto' is resolved by the tuner per call"):
        expert_parallel(torch.zeros(3, 4), torch.tensor([3]), lambda r, c: r, None, "auto")


def test_padded_groups_are_zero_filled_to_the_alignment_and_dropped_after():
    from torch_commopt.kernels.moe.exchange import ranges
    from torch_commopt.kernels.moe.module import padded

    rows, per = torch.randn(11, 3), torch.tensor([0, 5, 6])
    seen = []

    def run(r, sizes):
        seen.append((sizes.tolist(), r.clone()))
        return r * 2 + 1

    out = padded(run, 4)(rows, per)
    assert torch.equal(out, rows * 2 + 1)
    (sizes, given), = seen
    assert sizes == [4, 8, 8]  # an empty group still gets 4 rows
    assert torch.equal(given[4:9], rows[:5]) and torch.equal(given[12:18], rows[5:])
    assert not given[:4].any() and not given[9:12].any() and not given[18:].any()
    assert ranges([(5, 2), (0, 0), (1, 3)], "cpu").tolist() == [5, 6, 1, 2, 3]


@pytest.mark.parametrize("covers", [True, False])
def test_gather_rows_matches_index_select_forward_and_backward(covers):
    # its backward writes each row's gradient once instead of index_select's atomic accumulation
    from torch_commopt.kernels.moe.exchange import gather_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 5, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.randperm(12, generator=g)[: 12 if covers else 7]
    dy = torch.randn(index.numel(), 5, dtype=torch.float64, generator=g)
    y = gather_rows(x, index, covers)
    (gx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = x2.index_select(0, index)
    (gx2,) = torch.autograd.grad(y2, x2, dy)
    assert torch.equal(y, y2) and torch.equal(gx, gx2)
    if not covers:
        missing = torch.ones(12, dtype=torch.bool)
        missing[index] = False
        assert missing.any() and not gx[missing].any()  # rows no output came from get zeros, not garbage


def test_counts_on_keeps_the_host_values_so_the_experts_read_no_device_tensor():
    from torch_commopt.kernels.moe.exchange import counts_on, host_counts

    t = counts_on((3, 0, 5), "cpu", torch.int32)
    assert t.dtype == torch.int32 and t.tolist() == [3, 0, 5]
    t.fill_(7)  # host_counts answers from the values kept, not from the tensor
    assert host_counts(t) == [3, 0, 5]
    assert host_counts(torch.tensor([1, 2])) == [1, 2]  # any other tensor is read
