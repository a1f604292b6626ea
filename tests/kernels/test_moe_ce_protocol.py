"""by_expert's copy-engine exchange (kernels/moe/ce_exchange.py) on the CPU: each rank's real
forward and backward run with CUDA faked (fake_cuda.py) and the exchange forced to the copy
engine, and what they queued -- token takes, DMAs into peers' slots, data flags, the reads out of
the slots, the releases -- is run by protocol_sim.py in several interleavings of every rank's
streams: no deadlock, no DMA into a slot a peer still reads, no read before the piece landed, every
flag back at rest.  Two calls back to back (fwd, bwd, fwd, bwd), skewed routing with empty pieces,
several chunk counts; a planted bug (a release that gives no token back) is caught.  Calls of
other row counts back to back, under one slot layout and across layouts: a pass's first push to
a peer waits for both regions' tokens (CEExchange._drained), without which a pass whose slots
grew races with the pass before."""

from __future__ import annotations

import types

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from protocol_sim import Deadlock, NotAtRest, Race, simulate

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


def _sized_routings(world: int, seed: int, extra: int) -> list[Routing]:
    """Every rank's Routing from random counts[p][q][e] in 0..3, plus `extra` rows for each expert
    of every peer: the call's per-peer row counts, and past a peak of 256 rows its slot
    (ce_exchange.slot_bytes), follow it."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (world, world, NL), generator=g)
    counts += extra * (1 - torch.eye(world, dtype=counts.dtype))[:, :, None]
    peak = int(counts.sum(dim=(1, 2)).max())
    return [Routing(p, world, tuple(tuple(counts[p, q].tolist()) for q in range(world)),
                    tuple(tuple(counts[s, p].tolist()) for s in range(world)), peak) for p in range(world)]


def _queue_calls(world: int, chunks: int, seed: int, calls: int = 2, break_release: bool = False,
                 break_arrival: bool = False, input_grad: bool = True, routed: list | None = None):
    """routed: each call's routings (one call each), instead of `calls` calls of seed's."""
    runtimes, queue = fake_runtimes(world, owned=(ce_exchange.PURPOSE,)), []
    group = types.SimpleNamespace(group_name="fake", size=lambda: world)
    routed = routed or [_routings(world, seed)] * calls
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
            for routings in routed:
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


# Calls of other row counts back to back.  The exchange has no buffer halves (nothing a replay
# could leave unswitched: it never runs in a capture, and its tokens are per region, not per
# epoch), so every pass rewrites the slots of the pass before; a source's slot is the call's peak
# rows rounded up to a power of two (at least 256), so calls whose peaks stay under 256 rows keep
# one layout, and a peak past it moves every slot but the first (the fake buffer is 1 MiB: on a
# GPU the buffer has grown already, by an earlier call of the larger peak, as the first here).
ONE_LAYOUT = [5, 20, 0]  # extra rows a peer and expert, call by call: peaks under 256
GROWN_LAYOUT = [100, 0, 100]  # ~300 rows to the peers: 512-row slots, then 256, then 512


def _layout_calls(world: int, extras: list[int]) -> list:
    return [_sized_routings(world, seed, extra) for seed, extra in enumerate(extras)]


@pytest.mark.parametrize("world,chunks", [(2, 1), (3, 2)])
def test_passes_of_other_row_counts_in_one_slot_layout_wait_for_the_reads(world, chunks):
    queue, runtimes = _queue_calls(world, chunks, 0, routed=_layout_calls(world, ONE_LAYOUT))
    peaks = [r[0].peak for r in _layout_calls(world, ONE_LAYOUT)]
    assert len(set(peaks)) == 3 and len({ce_exchange.slot_bytes(p, 16) for p in peaks}) == 1  # one slot
    for order in range(8):
        simulate(queue, runtimes, seed=order)


@pytest.mark.parametrize("world,chunks", [(2, 1), (3, 2)])
def test_a_pass_whose_slots_grew_waits_for_the_reads_of_the_pass_before(world, chunks):
    peaks = [r[0].peak for r in _layout_calls(world, GROWN_LAYOUT)]
    assert len({ce_exchange.slot_bytes(p, 16) for p in peaks}) == 2  # 256-row slots between larger ones
    queue, runtimes = _queue_calls(world, chunks, 0, routed=_layout_calls(world, GROWN_LAYOUT))
    for order in range(12):
        simulate(queue, runtimes, seed=order)


@pytest.mark.parametrize("world,chunks", [(2, 1), (3, 2)])
def test_a_pass_whose_slots_grew_without_the_drain_races_with_the_pass_before(world, chunks, monkeypatch):
    # planted: a pass's first push to a peer waits only for the token of the region it writes.
    # (A push that waits for no token at all is not caught under one layout: a pass's first push
    # into a region of a peer already follows, through the data it waited for, that peer's reads
    # of the region in the pass before.)
    monkeypatch.setattr(ce_exchange.CEExchange, "_drained", lambda self, region, q, chunk: None)
    queue, runtimes = _queue_calls(world, chunks, 0, routed=_layout_calls(world, GROWN_LAYOUT))
    with pytest.raises(Race):
        for order in range(8):
            simulate(queue, runtimes, seed=order)
