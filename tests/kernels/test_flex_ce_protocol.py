"""The flex all-gather's copy-engine K/V moves (kernels/attention/ce_gather.py) on the CPU: each
rank's real host code runs with CUDA faked (fake_cuda.py), and what it queued -- token takes, DMAs
into peers' slots, data flags, the copies and the sum out of the slots, the releases -- is run by
protocol_sim.py in several interleavings of every rank's streams: no deadlock, no DMA into a slot
a peer still reads, no read of a piece before it landed, every flag back at rest.  Gathers and
sums back to back (both buffer halves reused), and between the matmul schedules' calls, which
share the buffers, flags and tokens; planted bugs (a sum that does not wait for its pieces, a
call that gives no token back) are caught.  Calls of other lengths in one buffer half: gathers and
sums after a replayed call (a CUDA-graph replay takes no epoch), and the copy-engine all-to-alls
(ce_a2a.py) and rings (ce_ring.py), whose calls all start in half 0, back to back (a ring's first
push waits for both halves' tokens: without, a longer ring after a shorter one races over three
ranks; ce_pull runs over two ranks only, since a third rank's pulls are guarded by no token a
writer holds)."""

from __future__ import annotations

import types

import pytest
import torch
from fake_cuda import FakeStream, _tensor_rows, fake_runtimes, faked_cuda
from protocol_sim import Deadlock, NotAtRest, Race, _flag, simulate

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.attention import ce_a2a, ce_gather, ce_ring
from torch_commopt.kernels.gpu import symm
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.product import Product

B, H, L, D = 1, 2, 8, 4  # a rank's K/V block (tiny fp32)
GROUP = types.SimpleNamespace(group_name="fake")


def _recorded_sum(queue, active):
    """ce_gather._sum, recorded as a copy that reads every part's rows (the slots' among them)."""
    real = ce_gather._sum

    def summed(parts, dtype):
        out = real(parts, dtype)
        written = _tensor_rows(out)
        read = tuple(r for p in parts for r in _tensor_rows(p))
        queue.append((active["rank"], torch.cuda.current_stream().cuda_stream,
                      ("copy", out.data_ptr(), written[0][1] - written[0][0], written, read)))
        return out
    return summed


def _recorded_within(queue, active):
    """ce_gather._inside and _sum_within, recorded as copies: the first reads the header's span,
    the second the own rows and the slot's rows within the span the peer sent (active["cut"]: the
    call's CUT_SENT; the rest of the slot is read too, and thrown away by the where, whatever it
    holds)."""
    real_inside, real_sum = ce_gather._inside, ce_gather._sum_within

    def record(out, read):
        written = _tensor_rows(out)
        queue.append((active["rank"], torch.cuda.current_stream().cuda_stream,
                      ("copy", out.data_ptr(), written[0][1] - written[0][0], written, read)))

    def inside(span, length):
        out = real_inside(span, length)
        record(out, _tensor_rows(span))
        return out

    def summed(own, slot, inside):
        out = real_sum(own, slot, inside)
        sent = active["cut"][1 - active["rank"]]
        record(out, _tensor_rows(own) + (_tensor_rows(slot[:, :, sent[0]:sent[1]]) if sent else ()))
        return out
    return inside, summed


# a cut reduce-scatter's spans, by the sending rank: of the peer's share (tokens), None for none
CUT_SENT = {"cut scatter": [(2, L - 2), (1, L)], "cut scatter none": [None, None]}


def _call(name: str, world: int, rank: int = 0):
    gen = torch.Generator().manual_seed(len(name) + world)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    name, _, length = name.partition(" L=")  # "gather L=20": another block length than L (other slots)
    n = int(length) if length else L
    if name == "gather":
        k, v = rnd(B, H, n, D), rnd(B, H, n, D)
        return lambda: ce_gather.all_gather_kv(k, v, GROUP)
    if name == "scatter":
        gk, gv = rnd(B, H, world * n, D), rnd(B, H, world * n, D)
        return lambda: ce_gather.reduce_scatter_kv(gk, gv, GROUP)
    if name in CUT_SENT:
        gk, gv = rnd(B, H, world * n, D), rnd(B, H, world * n, D)
        return lambda: ce_gather.reduce_scatter_kv_cut(gk, gv, GROUP, CUT_SENT[name][rank])
    if name in ("pulled", "pulled none"):  # spans per source: rank 0 pulls spans[1], rank 1 spans[0]
        k, v = rnd(B, H, n, D), rnd(B, H, n, D)
        spans = [None, None] if name == "pulled none" else [(2, n - 2), (1, n)]
        return lambda: ce_gather.all_gather_kv_pulled(k, v, GROUP, spans)
    op, sched = name.split(" ")
    s = Schedule.parse(sched)
    if op == "ag":
        a, ws = rnd(24 // world, 16), [rnd(16, 8)]
        return lambda: agm.ag_matmul_gpu(a, ws, [None], 0, "fake", s, True)
    a, w = rnd(24, 16), rnd(16, 8)
    return lambda: mr.matmul_rs_gpu(Product(a, w), 0, "sum", "fake", s)


def _queue(world: int, names: list[str]) -> tuple[list, list]:
    runtimes, queue = fake_runtimes(world), []
    with faked_cuda(runtimes, queue) as active:
        state = {"rank": 0}

        def switch(rank: int) -> None:
            state["rank"] = rank
            active(rank)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ce_gather, "_sum", _recorded_sum(queue, state))
            inside, summed = _recorded_within(queue, state)
            mp.setattr(ce_gather, "_inside", inside)
            mp.setattr(ce_gather, "_sum_within", summed)
            for name in names:  # every rank queues the call, then the next: the GPUs run them later
                if name == "replayed":  # the call before took no epoch (a CUDA-graph replay): REPLAYED
                    for rt in runtimes:
                        rt.rewind(rt.epoch - 1)
                    continue
                state["cut"] = CUT_SENT.get(name)
                for rank in range(world):
                    switch(rank)
                    _call(name, world, rank)()
    return queue, runtimes


FLEX = ["gather", "gather", "scatter", "gather", "scatter", "scatter"]
MIXED = ["gather", "ag ce_push:1", "scatter", "rs ce_push:1", "gather", "ag ce_push:2", "scatter"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_gathers_and_sums_neither_deadlock_nor_race_nor_read_early(world):
    queue, runtimes = _queue(world, FLEX)
    assert any(op[0] == "copy" for _, _, op in queue) and any(op[0] == "wait" for _, _, op in queue)
    for seed in range(8):
        simulate(queue, runtimes, seed, shared_reads=True)  # every write into the buffer is a DMA here
    assert all(not rt._untaken for rt in runtimes)


@pytest.mark.parametrize("world", [2, 3])
def test_between_the_matmul_schedules_calls_the_protocol_holds(world):
    queue, runtimes = _queue(world, MIXED)
    for seed in range(8):
        simulate(queue, runtimes, seed)
    assert all(not rt._untaken for rt in runtimes)


def test_a_sum_that_does_not_wait_for_its_pieces_reads_early(monkeypatch):
    monkeypatch.setattr(ce_gather._Call, "arrived", lambda self, stream: None)
    queue, runtimes = _queue(2, ["scatter", "scatter"])
    with pytest.raises(Race):
        for seed in range(8):
            simulate(queue, runtimes, seed, shared_reads=True)


def test_a_call_that_gives_no_token_back_stalls_the_next_on_its_half(monkeypatch):
    monkeypatch.setattr(ce_gather._Call, "finish", lambda self, op: None)
    queue, runtimes = _queue(2, ["gather", "gather", "gather"])
    with pytest.raises((Deadlock, NotAtRest)):
        simulate(queue, runtimes, 0, shared_reads=True)


# A CUDA-graph replay takes no epoch (symm.GroupRuntime.next_epoch), so the eager call after it
# lands in the replayed call's buffer half ("replayed": every runtime's epoch rewound by one, as in
# test_protocol_sim.py's REPLAYED).  ce_gather's half is rt.next_epoch() % 2 and its slots follow
# the block length, so a call of another length covers other bytes of that half under the same
# tokens.  ce_gather itself never runs in a capture: the sequences of gathers and sums alone are
# the conservative check, a matmul schedule's replayed call before a gather the realistic one.
REPLAYED = {
    "gather, longer gather": ["gather", "replayed", "gather L=20"],
    "gather, shorter gather": ["gather L=20", "replayed", "gather"],
    "sum, longer sum": ["scatter", "replayed", "scatter L=20"],
    "gather, sum, gather": ["gather L=20", "replayed", "scatter", "replayed", "gather L=12"],
}
REPLAYED_MIXED = {
    "ag, gather": ["ag ce_push:1", "replayed", "gather L=20"],
    "rs ce_push, gather": ["rs ce_push:1", "replayed", "gather L=20"],
    "gemm=whole, sum": ["ag ce_push:1:gemm=whole", "replayed", "scatter L=20"],
    "ce_pull, gather": ["rs ce_pull:2", "replayed", "gather L=20"],
    "ce_pull, sum": ["rs ce_pull:2", "replayed", "scatter L=20"],
}


def _one_half(queue) -> bool:
    """Whether every token given back in `queue` is of one buffer half (the calls shared it)."""
    given = [_flag(op[1])[1] for _, _, op in queue if op[0] == "write" and op[2] == 1]
    halves = {(i - symm.FREE) // symm.MAX_WORLD for i in given if symm.FREE <= i < symm.FREE + symm.HALVES * symm.MAX_WORLD}
    return len(halves) == 1


# each sequence with whether the shared buffer's reads are checked too (the gathers' and sums' own
# writes into it are all copies; a matmul call's GEMMs write it unseen)
REPLAYED_ALL = {**{name: (calls, True) for name, calls in REPLAYED.items()},
                **{name: (calls, False) for name, calls in REPLAYED_MIXED.items()}}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", sorted(REPLAYED_ALL))
def test_a_gather_or_sum_in_a_replayed_calls_half_waits_for_its_reads(world, sequence):
    calls, shared_reads = REPLAYED_ALL[sequence]
    queue, runtimes = _queue(world, calls)
    assert _one_half(queue)
    for seed in range(12):
        simulate(queue, runtimes, seed, shared_reads=shared_reads)
    assert all(not rt._untaken for rt in runtimes)


@pytest.mark.parametrize("world", [2, 3])
def test_a_gather_that_takes_no_token_races_in_a_replayed_calls_half(world, monkeypatch):
    monkeypatch.setattr(symm.GroupRuntime, "acquire", lambda self, *args, **kwargs: None)  # planted
    for sequence in [*REPLAYED.values(), *REPLAYED_MIXED.values()]:
        queue, runtimes = _queue(world, sequence)
        with pytest.raises(Race):
            for seed in range(12):
                simulate(queue, runtimes, seed, shared_reads=sequence in REPLAYED.values())


# The all-to-all's and the ring's halves are not the epoch's: ce_a2a's is the head group's
# (g % 2, every call starts in half 0), ce_ring's the step's (every ring starts in half 0), each
# in a buffer of its own (own_buffer), so any two calls share a half, replayed or not, and a
# call of another shape lays that half out anew: nothing to rewind, the calls back to back are
# the check.

def _a2a_shapes_queue(world: int, plan: list[tuple], monkeypatch) -> tuple[list, list]:
    """ce_a2a.pipelined calls of several shapes, every rank's in turn: ("fwd", tokens a rank
    holds, head groups, keep the moved tensors) or ("bwd", tokens, head groups)."""
    monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, "0")
    monkeypatch.setattr(ce_a2a, "_SECOND", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def call(kind: str, s_loc: int, groups: int, keep: bool = False):
        h, h_kv, sm = 2 * world * groups, world * groups, s_loc * world
        hq, hk = h // (groups * world), h_kv // (groups * world)
        if kind == "bwd":
            dout = torch.randn(B, h, s_loc, D)
            specs = [(dout.shape, dout.dtype), ((B, h_kv, s_loc, D), dout.dtype), ((B, h_kv, s_loc, D), dout.dtype)]
            return lambda: ce_a2a.pipelined([dout], lambda dh: [dh * 2, torch.ones(B, hk, sm, D), torch.ones(B, hk, sm, D)],
                                            GROUP, groups, specs)
        q, k, v = torch.randn(B, h, s_loc, D), torch.randn(B, h_kv, s_loc, D), torch.randn(B, h_kv, s_loc, D)
        keep_in = [torch.empty(groups, B, x, sm, D) for x in (hq, hk, hk)] if keep else None
        keep_out = [torch.empty(groups, B, hq, sm, D)] if keep else None
        return lambda: ce_a2a.pipelined([q, k, v], lambda qh, kh, vh: [qh * 2], GROUP, groups, [(q.shape, q.dtype)],
                                        keep_in, keep_out)

    runtimes, queue = fake_runtimes(world, owned=(ce_a2a.PURPOSE,)), []
    with faked_cuda(runtimes, queue) as active:
        for entry in plan:
            for rank in range(world):
                active(rank)
                call(*entry)()
    return queue, runtimes


A2A_SHAPES = {  # each with a call whose layout outgrows the one before (what _drained guards)
    "longer forward": [("fwd", 4, 1), ("fwd", 12, 1, True)],
    "longer backward": [("bwd", 4, 1), ("bwd", 12, 1)],
    "backward, longer forward": [("bwd", 4, 1), ("fwd", 12, 1)],
    "steps": [("fwd", 12, 2, True), ("bwd", 12, 2), ("fwd", 4, 2, True), ("bwd", 4, 1), ("fwd", 12, 1), ("bwd", 12, 1)],
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("plan", sorted(A2A_SHAPES))
def test_all_to_alls_of_other_lengths_in_one_half_wait_for_the_reads(world, plan, monkeypatch):
    queue, runtimes = _a2a_shapes_queue(world, A2A_SHAPES[plan], monkeypatch)
    for seed in range(12):
        simulate(queue, runtimes, seed)


@pytest.mark.parametrize("world", [2, 3])
def test_an_all_to_all_of_another_length_that_does_not_drain_races(world, monkeypatch):
    monkeypatch.setattr(ce_a2a._Pipeline, "_drained", lambda self: None)  # planted: the missing drain back
    for plan in A2A_SHAPES.values():
        queue, runtimes = _a2a_shapes_queue(world, plan, monkeypatch)
        with pytest.raises(Race):
            for seed in range(12):
                simulate(queue, runtimes, seed)


def _rings_queue(world: int, lengths: list[int]) -> tuple[list, list]:
    """ce_ring.CEShift rings on channel 0 one after the other, each of blocks (K, V) of its
    length, world - 1 steps each (a ring attention call's)."""
    runtimes, queue = fake_runtimes(world, owned=(ce_ring.PURPOSE,)), []
    with faked_cuda(runtimes, queue) as active:
        for length in lengths:
            shifts = []
            for rank in range(world):
                active(rank)
                shifts.append(ce_ring.CEShift([torch.randn(B, H, length, D), torch.randn(B, H, length, D)], GROUP))
            for _ in range(world - 1):
                for step in ("start", "wait"):
                    for rank, shift in enumerate(shifts):
                        active(rank)
                        getattr(shift, step)()
            for rank, shift in enumerate(shifts):
                active(rank)
                shift.finish()
    return queue, runtimes


@pytest.mark.parametrize("world", [2, 3])
def test_a_ring_of_longer_blocks_after_a_shorter_one_waits_for_its_reads(world):
    # the first ring the longest: the ring buffer has grown already (own_buffer keeps it), as on
    # a GPU, where a longer ring than any before makes a new buffer (a synchronizing rendezvous).
    # Over two ranks a ring has one step: its block lies in half 0, whose token the next ring takes
    queue, runtimes = _rings_queue(world, [16, 4, 16, 8])
    for seed in range(12):
        simulate(queue, runtimes, seed)


def test_a_ring_whose_first_push_waits_for_its_half_only_races_with_the_ring_before(monkeypatch):
    wait = symm.GroupRuntime.wait
    monkeypatch.setattr(symm.GroupRuntime, "wait", lambda self, stream, index, value, **kw:  # planted
                        None if kw.get("what") == "free ring slot" and kw.get("chunk") == -1
                        else wait(self, stream, index, value, **kw))
    queue, runtimes = _rings_queue(3, [16, 4, 16, 8])
    with pytest.raises(Race):
        for seed in range(12):
            simulate(queue, runtimes, seed)


def test_a_ring_that_takes_no_token_races_with_the_ring_before(monkeypatch):
    wait = symm.GroupRuntime.wait
    monkeypatch.setattr(symm.GroupRuntime, "wait", lambda self, stream, index, value, **kw:  # planted
                        None if kw.get("what") == "free ring slot" else wait(self, stream, index, value, **kw))
    queue, runtimes = _rings_queue(2, [16, 4, 16, 8])
    with pytest.raises(Race):
        for seed in range(12):
            simulate(queue, runtimes, seed)


# The pulled all-gather (two ranks): each rank publishes its K/V in its own slot and pulls the
# peer's span out of the peer's buffer, as ce_pull's readers do.
PULLED = {
    "back to back": ["pulled", "pulled", "gather", "pulled none", "scatter", "pulled"],
    "between the matmul schedules": ["pulled", "ag ce_push:1", "rs ce_pull:2", "pulled", "rs ce_push:1", "pulled"],
    "ce_pull, replayed, pulled": ["rs ce_pull:2", "replayed", "pulled L=20"],
    "pulled, replayed, longer gather": ["pulled", "replayed", "gather L=20"],
    "gather, replayed, pulled": ["gather L=20", "replayed", "pulled"],
    "pulled, replayed, longer pulled": ["pulled", "replayed", "pulled L=20"],
    "ag, replayed, pulled": ["ag ce_push:1", "replayed", "pulled L=20"],
    "pulled, cut scatters": ["pulled", "cut scatter", "pulled", "cut scatter none", "scatter", "cut scatter"],
    "cut scatters between the matmul schedules": ["cut scatter", "ag ce_push:1", "rs ce_pull:2", "cut scatter",
                                                  "rs ce_push:1", "cut scatter none", "gather"],
    "gather, replayed, cut scatter": ["gather L=20", "replayed", "cut scatter"],
}
PULLED_READS_CHECKED = ("back to back", "pulled, replayed, longer gather", "gather, replayed, pulled",
                        "pulled, replayed, longer pulled", "pulled, cut scatters",
                        "gather, replayed, cut scatter")  # only copies write the buffer in these


@pytest.mark.parametrize("sequence", sorted(PULLED))
def test_pulled_gathers_neither_deadlock_nor_race_nor_read_early(sequence):
    queue, runtimes = _queue(2, PULLED[sequence])
    pulls = [op for _, _, op in queue if op[0] == "copy" and op[2] not in (B * H * 8 * D * 4,)]
    assert pulls  # the cut copies (a span's bytes a row, not the block's) are there
    for seed in range(12):
        simulate(queue, runtimes, seed, shared_reads=sequence in PULLED_READS_CHECKED)
    assert all(not rt._untaken for rt in runtimes)


def test_a_pulled_gather_pulls_only_its_span_of_the_peer_s_block():
    queue, _ = _queue(2, ["pulled"])
    span_rows = sorted({op[2] for rank, _, op in queue if op[0] == "copy" and op[2] < 8 * D * 4})
    assert span_rows == [4 * D * 4, 7 * D * 4]  # rank 1 pulls tokens [2, 6), rank 0 tokens [1, 8)
    none, _ = _queue(2, ["pulled none"])
    assert not [op for _, _, op in none if op[0] == "copy" and op[2] < 8 * D * 4]


def test_a_pulled_gather_that_takes_no_token_is_caught(monkeypatch):
    """Its publishing copy may land over bytes the peer still pulls, and its flags fall out of step
    with the peer's (a deadlock in some interleavings)."""
    monkeypatch.setattr(symm.GroupRuntime, "acquire", lambda self, *args, **kwargs: None)  # planted
    queue, runtimes = _queue(2, ["pulled L=20", "replayed", "pulled"])
    with pytest.raises((Race, Deadlock)):
        for seed in range(12):
            simulate(queue, runtimes, seed, shared_reads=True)


def test_a_pulled_gather_that_does_not_wait_for_the_peer_is_caught(monkeypatch):
    """It lowers the peer's data flag before the peer raised it (the simulator sees no pull without
    its wait: what it catches is the flag left raised)."""
    monkeypatch.setattr(ce_gather._Call, "landed", lambda self, stream, src: None)  # planted
    queue, runtimes = _queue(2, ["pulled", "pulled"])
    with pytest.raises((Race, NotAtRest)):
        for seed in range(12):
            simulate(queue, runtimes, seed, shared_reads=True)


def test_a_cut_scatter_pushes_its_span_and_its_header_and_sums_after_both_landed():
    def pushed(queue, runtimes):  # the side streams' copies, by their bytes a row
        side = {rt.side.cuda_stream for rt in runtimes}
        return sorted(op[2] for _, stream, op in queue if op[0] == "copy" and stream in side)

    queue, runtimes = _queue(2, ["cut scatter"])
    row = D * 4  # bytes a token of the tiny fp32 blocks
    # each rank: the 8-byte header, then K's and V's span (rank 0: tokens [2, 6), rank 1: [1, 8))
    assert pushed(queue, runtimes) == [8, 8, 4 * row, 4 * row, 7 * row, 7 * row]
    for seed in range(12):
        simulate(queue, runtimes, seed, shared_reads=True)
    assert pushed(*_queue(2, ["cut scatter none"])) == [8, 8]


def test_a_cut_scatter_that_sums_before_the_peer_s_span_landed_is_caught(monkeypatch):
    monkeypatch.setattr(ce_gather._Call, "arrived", lambda self, stream: None)  # planted
    queue, runtimes = _queue(2, ["cut scatter", "cut scatter"])
    with pytest.raises((Race, NotAtRest)):
        for seed in range(12):
            simulate(queue, runtimes, seed, shared_reads=True)


def test_a_cut_scatter_over_three_ranks_is_refused():
    with pytest.raises(ValueError, match="two ranks"):
        _queue(3, ["cut scatter"])


def test_a_cut_sum_adds_the_peer_s_rows_only_within_the_span():
    own, slot = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    slot[:, :, :2] = float("nan")  # outside the span the slot holds whatever was last written there
    got = ce_gather._sum_within(own, slot, ce_gather._inside(torch.tensor([2, 6], dtype=torch.int32), L))
    assert torch.equal(got[:, :, 2:6], own[:, :, 2:6] + slot[:, :, 2:6])
    assert torch.equal(got[:, :, :2], own[:, :, :2]) and torch.equal(got[:, :, 6:], own[:, :, 6:])


def test_a_pulled_gather_over_three_ranks_is_refused():
    with pytest.raises(ValueError, match="two ranks"):
        _queue(3, ["pulled"])


def test_the_copy_engine_moves_only_when_asked_for_on_cuda_tensors(monkeypatch):
    from torch_commopt.core import env

    group = types.SimpleNamespace(group_name="fake", size=lambda: 2)
    k = torch.randn(B, H, L, D)
    monkeypatch.setenv(env.ATTENTION_TRANSPORT, "nccl")
    assert not ce_gather.usable([k, k], group)
    monkeypatch.setenv(env.ATTENTION_TRANSPORT, "ce")
    assert not ce_gather.usable([k, k], group)  # CPU tensors: NCCL (gloo) moves them
    assert not ce_gather.usable([k, k], types.SimpleNamespace(group_name="one", size=lambda: 1))


def test_by_default_the_flex_all_gather_moves_on_the_copy_engine_and_the_ring_on_nccl(monkeypatch):
    """TORCH_COMMOPT_ATTENTION_TRANSPORT unset reads "auto": ce_gather's moves where everything
    else allows them (CUDA tensors, a group whose ranks agreed on peer access), the ring's
    shifts on NCCL; "ce" both, "nccl" neither; an unknown value is read as nccl."""
    from torch_commopt.core import env
    from torch_commopt.kernels.attention import ce_ring
    from torch_commopt.kernels.gpu import peers

    group = types.SimpleNamespace(group_name="fake", size=lambda: 2)
    fake = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), is_contiguous=lambda: True)
    monkeypatch.setattr(peers, "agreed", lambda group, device: (True, ""))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    want = {None: ("auto", True), "ce": ("ce", True), "nccl": ("nccl", False), "copy": ("nccl", False)}
    for value, (transport, gathers) in want.items():
        if value is None:
            monkeypatch.delenv(env.ATTENTION_TRANSPORT, raising=False)
        else:
            monkeypatch.setenv(env.ATTENTION_TRANSPORT, value)
        assert ce_ring.transport() == transport, value
        assert ce_gather.usable([fake, fake], group) is gathers, value
        assert ce_ring.usable([fake], group) is (value == "ce"), value
