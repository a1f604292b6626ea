"""by_expert's copy-engine exchange (kernels/moe/ce_exchange.py) on the CPU: each rank's real
forward and backward run with CUDA faked (fake_cuda.py) and the exchange forced to the copy
engine, and what they queued -- token takes, DMAs into peers' slots, data flags, the reads out of
the slots, the releases -- is run by protocol_sim.py in several interleavings of every rank's
streams: no deadlock, no DMA into a slot a peer still reads, no read before the piece landed, every
flag back at rest.  Two calls back to back (fwd, bwd, fwd, bwd), skewed routing with empty pieces,
several chunk counts; a planted bug (a release that gives no token back) is caught."""

from __future__ import annotations

import types

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from protocol_sim import Deadlock, NotAtRest, simulate

from torch_commopt.kernels.moe import by_expert as be
from torch_commopt.kernels.moe import ce_exchange
from torch_commopt.kernels.moe.exchange import Routing

D, H, NL = 4, 6, 3  # model dim, expert hidden dim, local experts per rank (float32 rows of 16 bytes)


def _routings(world: int, seed: int) -> list[Routing]:
    """Every rank's Routing from one global count matrix counts[p][q][e] (p routes to rank q's
    expert e); skewed: some pieces empty, rank 0 routes nothing."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (world, world, NL), generator=g)
    counts[0] = 0
    counts[:, :, 1] *= torch.randint(0, 2, (world, world), generator=g)
    peak = int(counts.sum(dim=(1, 2)).max())
    return [Routing(p, world, tuple(tuple(counts[p, q].tolist()) for q in range(world)),
                    tuple(tuple(counts[s, p].tolist()) for s in range(world)), peak) for p in range(world)]


def _queue_calls(world: int, chunks: int, seed: int, calls: int = 2, break_release: bool = False,
                 break_arrival: bool = False, input_grad: bool = True):
    runtimes, queue = fake_runtimes(world, owned=(ce_exchange.PURPOSE,)), []
    group = types.SimpleNamespace(group_name="fake", size=lambda: world)
    routings = _routings(world, seed)
    outs: dict[int, torch.Tensor] = {}
    with faked_cuda(runtimes, queue) as active:
        patches = [(ce_exchange, "usable", lambda x, grp: True)]
        if break_release:
            patches.append((ce_exchange.CEExchange, "release", lambda self, region: None))
        if break_arrival:  # a planted bug: the pieces read without waiting for their data flags
            landed = ce_exchange.CEExchange.landed

            def unwaited(self, *args):
                wait, self.rt.wait = self.rt.wait, lambda *a, **k: None
                try:
                    return landed(self, *args)
                finally:
                    self.rt.wait = wait

            patches.append((ce_exchange.CEExchange, "landed", unwaited))
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, value in patches:
            setattr(obj, name, value)
        try:
            for _ in range(calls):
                for phase in ("forward", "backward"):
                    for rank in range(world):
                        active(rank)
                        r = routings[rank]
                        if phase == "forward":
                            x = torch.randn(sum(map(sum, r.send)), D, requires_grad=input_grad)
                            ws = [torch.randn(NL, H, D, requires_grad=True), torch.randn(NL, D, H, requires_grad=True),
                                  torch.randn(NL, H, D, requires_grad=True)]
                            outs[rank] = be.by_expert(x, r, ws, group, chunks)
                        else:
                            outs[rank].backward(torch.randn_like(outs[rank]))
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)
    return queue, runtimes


@pytest.mark.parametrize("world,chunks", [(2, 1), (2, 2), (3, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_exchange_protocol_runs_to_rest_in_every_interleaving(world, chunks, seed):
    queue, runtimes = _queue_calls(world, chunks, seed)
    assert any(op[0] == "copy" for _, _, op in queue)  # pieces did move by DMA
    for order in range(4):
        simulate(queue, runtimes, seed=order)


def test_a_backward_that_sends_no_input_gradient_leaves_every_flag_at_rest():
    # an input that needs no gradient: the backward posts no input gradient home (no OUT region)
    queue, runtimes = _queue_calls(2, 2, 0, input_grad=False)
    for order in range(4):
        simulate(queue, runtimes, seed=order)


def test_pieces_read_in_place_before_their_flag_are_caught():
    """The forward and backward read landed pieces where they lie (Arrival.place): those reads are
    in the recorded protocol, so one made before its data flag is an early read."""
    queue, runtimes = _queue_calls(2, 2, 0, break_arrival=True)
    with pytest.raises(AssertionError, match="(?i)read"):
        simulate(queue, runtimes, seed=0)


def test_a_release_that_gives_no_token_back_is_caught():
    queue, runtimes = _queue_calls(2, 2, 0, break_release=True)
    with pytest.raises((Deadlock, NotAtRest)):
        simulate(queue, runtimes, seed=0)
