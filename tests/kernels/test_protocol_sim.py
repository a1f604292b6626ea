"""The GPU schedules' flag protocol across ranks, on the CPU: each rank's real host code
(ag_matmul_gpu, matmul_rs_gpu, matmul_ar_gpu) runs with CUDA faked (fake_cuda.py), and what it
queued -- flag waits and writes, batched take-and-signal, copies, events -- is executed by
protocol_sim.py in several interleavings of every rank's streams: no deadlock, no copy into a
buffer half its reader still reads, every flag back at rest.  Sequences of calls mix ops and
piece counts, so both buffer halves are reused across ops; the attention's copy-engine
all-to-alls run a Ulysses training step (the forward keeping its moved tensors), and the
copy-engine ring runs rings on both channels.  The compute kernels' writes into the buffers
(GEMM outputs, Tensor.copy_) are checked as the copies are, and a ce_pull reader's copies out of
its source's buffer hold those bytes until it gives the token back: a call that lands in a
replayed ce_pull's half (a CUDA-graph replay takes no epoch) must not write them before.
Planted protocol bugs are caught."""

from __future__ import annotations

import sys

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from protocol_sim import Deadlock, NotAtRest, Race, _flag, simulate

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import symm
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.product import Product

M, K, N = 24, 16, 8  # global rows, contracted dim, output columns (tiny fp32)


def _call(name: str, world: int):
    op, sched, *extra = name.split(" ")
    s = Schedule.parse(sched)
    gen = torch.Generator().manual_seed(len(name))
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    # "... m=48": another global row count than M (other slot offsets in the buffer half)
    m = next((int(x[2:]) for x in extra if x.startswith("m=")), M)
    # "ag3" / "rs3": a (2, rows, K) activation gathered / scattered along dim 1 (outer blocks:
    # strided row blocks multiplied by batched GEMMs, the gathered copy a 2-D one)
    blocked = op.endswith("3")
    op = op.rstrip("3")
    if op == "ag":
        a, ws = rnd(m // world * 2, K), [rnd(K, N), rnd(K, N)]
        a = a.view(2, m // world, K) if blocked else a
        return lambda: agm.ag_matmul_gpu(a, ws, [None, None], int(blocked), "fake", s, True)
    a, w = rnd(m, K), rnd(K, N)
    parts = ((rnd(m, 4), rnd(4, N)), (rnd(m, 6), rnd(6, N))) if "parts" in extra else ()  # "... parts": K parts
    if op == "rs" and blocked:
        a, parts = a.view(2, m // 2, K), tuple((x.view(2, m // 2, -1), y) for x, y in parts)
        return lambda: mr.matmul_rs_gpu(Product(a, w, parts=parts), 1, "sum", "fake", s)
    if op == "rs":
        return lambda: mr.matmul_rs_gpu(Product(a, w, parts=parts), 0, "sum", "fake", s)
    return lambda: mr.matmul_ar_gpu(Product(a, w, parts=parts), "sum", "fake", s)


SEQUENCES = {
    "ag": ["ag ce_push:1", "ag ce_push:1", "ag ce_push:2", "ag ce_push:1:par=1", "ag ce_push:1:gemm=whole"],
    "reductions": ["rs ce_push:1", "rs ce_push:2", "ar ce_push:1", "rs direct:1", "rs ce_pull:2", "ar ce_push:2"],
    "outer blocks": ["ag3 ce_push:1", "rs3 ce_push:1", "ag3 ce_push:2", "rs3 ce_pull:2 parts", "ag3 ce_push:1:par=1",
                     "rs3 direct:2", "rs3 ce_push:2 parts", "ag ce_push:1"],
    "mixed": ["ag ce_push:1", "rs ce_push:1", "ag ce_push:2", "ar ce_push:1", "rs direct:2", "ag ce_push:1"],
    "k parts": ["rs ce_push:1 parts", "rs ce_pull:2 parts", "ar ce_push:2 parts", "rs direct:2 parts",
                "ar ce_pull:2 parts", "rs ce_push:2 parts"],
}


# A CUDA-graph replay takes no epoch, so the eager call after it lands in the replayed call's
# half ("replayed": the call before took none).  There a ce_pull's source may still hold bytes
# its peer is to pull, in slots laid out by another row count than the next call's own slot:
# ce_push at W = 2 stages there, gemm=whole copies its shard there (commit 9f13be4).
REPLAYED = {
    "rs ce_push": ["rs ce_pull:2", "replayed", "rs ce_push:1 m=48"],
    "ag gemm=whole": ["rs ce_pull:2", "replayed", "ag ce_push:1:gemm=whole"],
}


def _queue(world: int, names: list[str]) -> tuple[list, list]:
    runtimes, queue = fake_runtimes(world), []
    with faked_cuda(runtimes, queue) as active:
        for name in names:  # every rank queues the call, then the next call: the GPUs run them later
            if name == "replayed":  # the call before took no epoch (module comment at REPLAYED)
                for rt in runtimes:
                    rt.rewind(rt.epoch - 1)
                continue
            for rank in range(world):
                active(rank)
                _call(name, world)()
    return queue, runtimes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", sorted(SEQUENCES))
def test_the_protocol_neither_deadlocks_nor_races_and_comes_to_rest(world, sequence):
    queue, runtimes = _queue(world, SEQUENCES[sequence])
    assert any(op[0] == "copy" for _, _, op in queue) and any(op[0] == "wait" for _, _, op in queue)
    for seed in range(8):  # the GEMMs' writes recorded (stores): the shared buffer's reads checked too
        simulate(queue, runtimes, seed, shared_reads=True)
    assert all(not rt._untaken for rt in runtimes)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", ["reductions", "mixed", "outer blocks"])
def test_tokens_given_back_from_the_side_stream_keep_the_protocol(world, sequence, monkeypatch):
    # env.tokens_on_side: every call's token writes leave the caller's stream for the side stream,
    # after an event on the caller's stream (its reads done, its flags lowered)
    monkeypatch.setenv(env.TOKENS_ON_SIDE, "1")
    queue, runtimes = _queue(world, SEQUENCES[sequence])
    given = [(r, s) for r, s, op in queue if op[0] == "write" and op[2] == 1 and _is_token(op[1])]
    assert given and all(s == runtimes[r].side.cuda_stream for r, s in given), given
    for seed in range(8):
        simulate(queue, runtimes, seed)
    assert all(not rt._untaken for rt in runtimes)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", sorted(REPLAYED))
def test_a_call_in_a_replayed_pulls_half_writes_its_own_slots_after_the_pulls(world, sequence):
    queue, runtimes = _queue(world, REPLAYED[sequence])
    given = [op[1] for _, _, op in queue if op[0] == "write" and _is_token(op[1]) and op[2] == 1]
    assert len({(_flag(a)[1] - symm.FREE) // symm.MAX_WORLD for a in given}) == 1  # both calls in one half
    assert any(op[0] == "store" for _, _, op in queue)  # the GEMMs' and copy_'s writes are seen
    for seed in range(12):
        simulate(queue, runtimes, seed, shared_reads=True)


def _pre_fix(monkeypatch) -> None:
    """Planted: 9f13be4 undone.  ce_push takes no token on the caller's stream before its
    products (the staging in the own slot at W = 2) but on the side stream at each peer's first
    copy out (the old _ship); gemm=whole waits for them on the side stream once it follows the
    caller's, so its copy of the own shard into the own slot waits for none."""
    acquire, rt_acquire = mr._Call.acquire, symm.GroupRuntime.acquire

    def late(self, stream, p, *, defer_take=False):
        caller = sys._getframe(1).f_code.co_name == "_reduce_scatter_into"
        if not (caller and stream is self.cur and self.sched.name == "ce_push"):
            acquire(self, stream, p, defer_take=defer_take)

    def old_ship(call, src_piece, dst_piece, p, c):
        call.after_caller()
        if c == 0:
            call.acquire(call.side, p, defer_take=True)
        call.rt.copy(call.side, dst_piece, src_piece)
        call.signal(call.side, p, c)

    def on_side(self, stream, peer, half, **kw):
        if sys._getframe(1).f_code.co_name == "_gather_and_multiply" and stream is not self.side:
            self.after(self.side, stream)  # as before: the side stream follows the caller's, then waits
            stream = self.side
        rt_acquire(self, stream, peer, half, **kw)

    monkeypatch.setattr(mr._Call, "acquire", late)
    monkeypatch.setattr(mr, "_ship", old_ship)
    monkeypatch.setattr(symm.GroupRuntime, "acquire", on_side)


@pytest.mark.parametrize("world", [2])  # over more ranks ce_pull runs ce_push (matmul_reduce.pull_placed)
@pytest.mark.parametrize("sequence", sorted(REPLAYED))
def test_an_own_slot_written_before_the_tokens_races_with_a_replayed_pull(world, sequence, monkeypatch):
    _pre_fix(monkeypatch)
    queue, runtimes = _queue(world, REPLAYED[sequence])
    with pytest.raises(Race, match="still pulls from there"):
        for seed in range(12):
            simulate(queue, runtimes, seed)


def test_ce_pull_runs_over_two_ranks_only():
    """Over three ranks and more ce_pull runs ce_push with the same pieces (a third rank's pulls
    of a peer's half are guarded by no token a writer into that half holds), keeping dbg and cg."""
    pull = Schedule.parse("ce_pull:3:cg=1,dbg=1")
    assert mr.pull_placed(pull, 2, "matmul_rs") is pull
    assert mr.pull_placed(pull, 3, "matmul_ar") == Schedule.parse("ce_push:3:cg=1,dbg=1")
    assert mr.pull_placed(Schedule.parse("direct:2"), 4, "matmul_rs") == Schedule.parse("direct:2")
    kinds = {name: [(rank, op[0]) for rank, _, op in _queue(3, [name])[0]] for name in ("rs ce_pull:2", "rs ce_push:2")}
    assert kinds["rs ce_pull:2"] == kinds["rs ce_push:2"]


def _is_token(address: int) -> bool:
    """Whether a flag address is a FREE token (a reader gives it back at a call's end)."""
    index = _flag(address)[1]
    return symm.FREE <= index < symm.FREE + symm.HALVES * symm.MAX_WORLD


def test_a_token_given_back_before_the_reads_end_races(monkeypatch):
    # the same, the side stream not ordered after the caller's reads: a token given back before
    # the peer took it for this very call is lost (the take overwrites it), or the peer's next
    # push lands on bytes this rank still reads
    monkeypatch.setenv(env.TOKENS_ON_SIDE, "1")
    ordered = symm.GroupRuntime.after

    def after(self, waiter, stream):  # done_reading's ordering of the side stream dropped, no other
        if waiter is self.side and sys._getframe(1).f_code.co_name == "done_reading":
            return None
        return ordered(self, waiter, stream)

    monkeypatch.setattr(symm.GroupRuntime, "after", after)
    queue, runtimes = _queue(2, ["rs ce_push:1", "rs ce_pull:2", "rs ce_push:1", "rs ce_pull:2"])
    with pytest.raises((Race, NotAtRest, Deadlock)):
        for seed in range(40):
            simulate(queue, runtimes, seed)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", ["ag", "outer blocks ag"])
@pytest.mark.parametrize("own_early", [False, True])
def test_the_gathered_copies_read_only_landed_pieces(world, sequence, own_early, monkeypatch):
    # ag_matmul's kept gathered input is copied out of the slots by the side stream, ordered
    # after the consumer's flag waits by an event (the cuBLAS consumer) or by waits of its own;
    # env.gather_own_early: this rank's rows copied on the local stream under its own GEMM
    if own_early:
        monkeypatch.setenv(env.GATHER_OWN_EARLY, "1")
    names = [n for n in SEQUENCES[sequence.removesuffix(" ag")] if n.startswith("ag")]
    queue, runtimes = _queue(world, names)
    local = [r for r, s, op in queue if op[0] == "copy" and s == runtimes[r].local.cuda_stream]
    assert bool(local) == own_early, local  # the own rows' copies on the local stream only when asked
    for seed in range(12):
        simulate(queue, runtimes, seed, shared_reads=True)


def test_gathered_copies_not_ordered_after_the_flag_waits_read_early(monkeypatch):
    def unordered(call, slots, gathered, side, stream, src, first, own=True):  # _gather_landed without its event
        if first and own:
            agm._gather_rows(call, slots, gathered, side, call.rt.rank)
        agm._gather_rows(call, slots, gathered, side, src)
    monkeypatch.setattr(agm, "_gather_landed", unordered)
    queue, runtimes = _queue(2, ["ag ce_push:1", "ag ce_push:2"])
    with pytest.raises(Race, match="before any piece landed"):
        for seed in range(40):
            simulate(queue, runtimes, seed, shared_reads=True)


def test_a_token_never_given_back_deadlocks_the_next_call_on_that_half(monkeypatch):
    def forgetful(self, stream, half, chunks, *, phases=1):
        for src in self.sources:  # lowers the flags, keeps the tokens
            for c in range(chunks):
                symm.driver.write_value32(stream, self.flag_address(self.rank, symm.data_index(half, src, c)), 0)
    monkeypatch.setattr(symm.GroupRuntime, "done_reading", forgetful)
    queue, runtimes = _queue(2, SEQUENCES["ag"][:3])
    with pytest.raises(Deadlock, match="no stream can move"):
        simulate(queue, runtimes, 0)


def _writer_runs_ahead(monkeypatch):
    """The side stream no longer forks from the caller's: a rank's pushes of its next calls may
    run while its peer still reads an earlier one (only the tokens hold them back)."""
    real = symm.GroupRuntime.after

    def after(self, waiter, stream):
        if waiter is not self.side:
            real(self, waiter, stream)
    monkeypatch.setattr(symm.GroupRuntime, "after", after)


def test_the_tokens_alone_hold_back_a_writer_that_runs_ahead(monkeypatch):
    _writer_runs_ahead(monkeypatch)
    queue, runtimes = _queue(2, SEQUENCES["ag"][:4])
    for seed in range(20):
        simulate(queue, runtimes, seed)


def test_a_writer_that_runs_ahead_without_the_tokens_races(monkeypatch):
    _writer_runs_ahead(monkeypatch)
    real = symm.GroupRuntime.wait

    def impatient(self, stream, index, value, **kw):
        if kw.get("what") != "free buffer":
            real(self, stream, index, value, **kw)
    monkeypatch.setattr(symm.GroupRuntime, "wait", impatient)
    queue, runtimes = _queue(2, SEQUENCES["ag"][:4])
    with pytest.raises(Race, match="still reads what was there"):
        for seed in range(50):
            simulate(queue, runtimes, seed)


def test_flags_left_raised_are_not_at_rest(monkeypatch):
    monkeypatch.setattr(symm.GroupRuntime, "done_reading", lambda self, *a, **k: None)
    queue, runtimes = _queue(2, SEQUENCES["ag"][:1])
    with pytest.raises(NotAtRest):
        simulate(queue, runtimes, 0)


def _a2a_calls(world: int, concurrent: bool = False, rank: int = 0):
    """The attention's copy-engine all-to-alls (ce_a2a.pipelined) as a Ulysses training step
    runs them: a forward that keeps its moved inputs and results, a backward moving dout alone
    with three results back; 1 and 2 head groups (both buffer halves within a call);
    concurrent: the odd groups' compute on the second compute stream (where the switch is on);
    then ulysses:early's staged computes (rank: whose calls these are)."""
    from types import SimpleNamespace

    from torch_commopt.kernels.attention import ce_a2a

    group = SimpleNamespace(group_name="fake")
    b, s_loc, d = 2, 4, 8
    h, h_kv = 4 * world, 2 * world

    def forward(groups: int, keep: bool):
        q, k, v = torch.randn(b, h, s_loc, d), torch.randn(b, h_kv, s_loc, d), torch.randn(b, h_kv, s_loc, d)
        hq, hk, sm = h // (groups * world), h_kv // (groups * world), s_loc * world
        keep_in = [torch.empty(groups, b, x, sm, d) for x in (hq, hk, hk)] if keep else None
        keep_out = [torch.empty(groups, b, hq, sm, d)] if keep else None
        return lambda: ce_a2a.pipelined([q, k, v], lambda qh, kh, vh: [qh * 2], group, groups, [(q.shape, q.dtype)],
                                        keep_in, keep_out, concurrent=concurrent)

    def backward(groups: int):
        dout = torch.randn(b, h, s_loc, d)
        hk, sm = h_kv // (groups * world), s_loc * world
        specs = [((b, h, s_loc, d), dout.dtype), ((b, h_kv, s_loc, d), dout.dtype), ((b, h_kv, s_loc, d), dout.dtype)]
        return lambda: ce_a2a.pipelined([dout], lambda dh: [dh * 2, torch.ones(b, hk, sm, d), torch.ones(b, hk, sm, d)],
                                        group, groups, specs, concurrent=concurrent)
    def early(groups: int):
        """ulysses:early's staged forward (own_first: the own block before the wait, each
        piece pushed back once final, so a peer's piece leaves before the own rows are done)
        keeping its tensors, then a backward."""
        from torch_commopt.kernels.attention import own_first

        q, k, v = torch.randn(b, h, s_loc, d), torch.randn(b, h_kv, s_loc, d), torch.randn(b, h_kv, s_loc, d)
        hq, hk, sm = h // (groups * world), h_kv // (groups * world), s_loc * world
        kept = [torch.empty(groups, b, x, sm, d) for x in (hq, hk, hk, hq)] + [torch.empty(groups, b, hq, sm)]
        kw = dict(me=rank, n=world, causal=True, scale=0.1, backend="math")

        def step():
            ce_a2a.pipelined([q, k, v], own_first.Forward(**kw, kept_lse=kept[4]), group, groups,
                             [(q.shape, q.dtype)], kept[:3], kept[3:4], concurrent=concurrent)
            backward(groups)()  # its backward is plain ulysses's
        return step
    return [forward(2, True), backward(2), forward(1, False), forward(1, True), backward(1), early(1),
            forward(2, True), backward(2), early(2)]


def _fake_group_streams(monkeypatch, concurrent: bool = False) -> None:
    """ce_a2a's head groups on one compute stream or two, the second stream faked per test (the
    CPU tensors name no device index)."""
    from fake_cuda import FakeStream

    from torch_commopt.kernels.attention import ce_a2a

    monkeypatch.setenv(ce_a2a.GROUP_STREAMS_ENV, "1" if concurrent else "0")
    monkeypatch.setattr(ce_a2a, "_SECOND", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _a2a_queue(world: int, concurrent: bool = False):
    from torch_commopt.kernels.attention import ce_a2a

    runtimes, queue = fake_runtimes(world, owned=(ce_a2a.PURPOSE,)), []
    calls = [_a2a_calls(world, concurrent, rank) for rank in range(world)]  # every rank's own tensors
    with faked_cuda(runtimes, queue) as active:
        for i in range(len(calls[0])):
            for rank in range(world):
                active(rank)
                calls[rank][i]()
    return queue, runtimes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("concurrent", [False, True], ids=["one_stream", "two_streams"])
def test_the_attention_all_to_alls_with_kept_tensors_neither_deadlock_nor_race(world, concurrent, monkeypatch):
    _fake_group_streams(monkeypatch, concurrent)
    queue, runtimes = _a2a_queue(world, concurrent)
    assert sum(op[0] == "copy" for _, _, op in queue) > 50
    # two streams: the odd groups wait for their pieces on a stream that is none of the runtimes'
    known = {s.cuda_stream for rt in runtimes for s in (rt.compute, rt.side, rt.local)}
    assert bool({stream for _, stream, op in queue if op[0] == "wait"} - known) == concurrent
    for seed in range(32):
        simulate(queue, runtimes, seed)


def test_an_all_to_all_slot_never_released_deadlocks(monkeypatch):
    from torch_commopt.kernels.attention import ce_a2a

    def keeps_the_tokens(self, region, half, stream):  # lowers its flags, gives no token back
        for src in self.rt.sources:
            self.driver.write_value32(stream, self.rt.flag_address(self.me, self._data(region, half, src)), 0)
    monkeypatch.setattr(ce_a2a._Pipeline, "_release", keeps_the_tokens)
    queue, runtimes = _a2a_queue(2)
    with pytest.raises(Deadlock):
        simulate(queue, runtimes, 0)


def test_a_reader_that_copies_every_result_out_after_the_first_arrived_reads_too_early(monkeypatch):
    """The results' data flag counts the results a source sent (ce_a2a._Back): a reader that
    waits for the first alone and copies them all out reads the later ones before they land
    in some interleavings (the simulator's early-read check)."""
    from torch_commopt.kernels.attention import ce_a2a

    _fake_group_streams(monkeypatch)
    arrived = ce_a2a._Pipeline._arrived
    monkeypatch.setattr(ce_a2a._Pipeline, "_arrived",
                        lambda self, region, half, g, stream, count=1: arrived(self, region, half, g, stream, 1))
    queue, runtimes = _a2a_queue(2)
    early = 0
    for seed in range(32):
        try:
            simulate(queue, runtimes, seed)
        except Race as e:
            early += "before any piece landed" in str(e)
    assert early


def _ring_queue(world: int):
    """attention/ce_ring.CEShift (its pushes are tensor copies, so only its flags and events are
    recorded): two rings one after the other on channel 0 and one on channel 1 between them,
    each of world - 1 steps, as a ring attention call runs them."""
    from types import SimpleNamespace

    from torch_commopt.kernels.attention import ce_ring

    group = SimpleNamespace(group_name="fake")
    runtimes, queue = fake_runtimes(world, owned=(ce_ring.PURPOSE, ce_ring.channel_purpose(1))), []
    with faked_cuda(runtimes, queue) as active:
        for channel in (0, 1, 0):
            shifts = []
            for rank in range(world):
                active(rank)
                shifts.append(ce_ring.CEShift([torch.randn(2, 4, 8), torch.randn(2, 4, 8)], group, channel))
            for _ in range(world - 1):
                for rank, shift in enumerate(shifts):
                    active(rank)
                    shift.start()
                for rank, shift in enumerate(shifts):
                    active(rank)
                    shift.wait()
            for rank, shift in enumerate(shifts):
                active(rank)
                shift.finish()
    return queue, runtimes


def _concurrent_rings_queue(world: int, channels: tuple[int, int]):
    """Two CEShift rings at once, as FlexAttention's backward runs them: K/V (bf16) and the
    dK/dV sums (fp32, larger slots), each step starting both, then waiting for both."""
    from types import SimpleNamespace

    from torch_commopt.kernels.attention import ce_ring

    group = SimpleNamespace(group_name="fake")
    runtimes, queue = fake_runtimes(world, owned=(ce_ring.PURPOSE, ce_ring.channel_purpose(1))), []
    with faked_cuda(runtimes, queue) as active:
        rings = []
        for rank in range(world):
            active(rank)
            kv = [torch.randn(2, 4, 8, dtype=torch.bfloat16), torch.randn(2, 4, 8, dtype=torch.bfloat16)]
            rings.append([ce_ring.CEShift(kv, group, channels[0]),
                          ce_ring.CEShift([torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)], group, channels[1])])
        for _ in range(world - 1):
            for step in ("start", "wait"):
                for rank, shifts in enumerate(rings):
                    active(rank)
                    for shift in shifts:
                        getattr(shift, step)()
        for rank, shifts in enumerate(rings):
            active(rank)
            for shift in shifts:
                shift.finish()
    return queue, runtimes


@pytest.mark.parametrize("world", [2, 3])
def test_two_rings_at_once_on_their_own_channels_keep_the_protocol(world):
    queue, runtimes = _concurrent_rings_queue(world, (0, 1))
    for seed in range(8):
        simulate(queue, runtimes, seed)


def test_two_rings_at_once_on_one_channel_are_caught():
    """What flex_ring's backward did before its dK/dV ring took channel 1."""
    queue, runtimes = _concurrent_rings_queue(3, (0, 0))
    with pytest.raises((Race, Deadlock, NotAtRest)):
        for seed in range(8):
            simulate(queue, runtimes, seed)


@pytest.mark.parametrize("world", [2, 3])
def test_the_copy_engine_ring_neither_deadlocks_and_comes_to_rest(world):
    queue, runtimes = _ring_queue(world)
    assert any(op[0] == "wait" for _, _, op in queue)
    for seed in range(8):
        simulate(queue, runtimes, seed)


def test_a_ring_slot_never_given_back_deadlocks_the_next_ring(monkeypatch):
    from torch_commopt.kernels.attention import ce_ring

    def keeps_the_token(self):  # lowers its data flag only
        if self.held is not None:
            data = self._index(self.symm.RING_DATA, self.held)
            self.symm.driver.write_value32(self.compute, self.rt.flag_address(self.rt.rank, data), 0)
    monkeypatch.setattr(ce_ring.CEShift, "_release", keeps_the_token)
    queue, runtimes = _ring_queue(2)
    with pytest.raises(Deadlock):
        simulate(queue, runtimes, 0)


def test_a_call_that_does_not_wait_for_the_peers_to_drain_races_on_a_new_layout(monkeypatch):
    """A forward (q, k, v in, out back) and its backward (dout in, dq, dk, dv back)
    lay the all-to-all buffer out differently, so one slot's token does not guard the bytes a
    peer still reads as another slot of the call before; without the drain at a call's first
    push (ce_a2a._Pipeline._drained) a push lands on them (the GPU test's plain backward over
    two head groups came out wrong)."""
    from torch_commopt.kernels.attention import ce_a2a

    _fake_group_streams(monkeypatch)
    monkeypatch.setattr(ce_a2a._Pipeline, "_drained", lambda self: None)
    queue, runtimes = _a2a_queue(2)
    raced = 0
    for seed in range(64):  # results copied out one by one as they arrive narrow the window: 26 of 300 seeds race
        try:
            simulate(queue, runtimes, seed)
        except Race:
            raced += 1
    assert raced


def _protocol(entries) -> list:
    """What of a call's queued work a CUDA graph of it fixes: each operation's stream and kind,
    and the flag operations' addresses and values (events by handle, not by record; copies
    without their addresses, which name per-call tensors here and a graph's own ones on a GPU)."""
    out = []
    for _, stream, op in entries:
        if op[0] in ("wait", "write"):
            out.append((stream, op[0], op[1], op[2]))
        elif op[0] in ("record", "wait_event"):
            out.append((stream, op[0], op[1]))
        else:
            out.append((stream, op[0]))
    return out


def _per_call_protocols(name: str, world: int, calls: int = 4) -> list:
    runtimes, queue, per_call = fake_runtimes(world), [], []
    with faked_cuda(runtimes, queue) as active:
        call = _call(name, world)
        for _ in range(calls):
            start = len(queue)
            active(0)
            call()
            per_call.append(_protocol(queue[start:]))
    return per_call


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_queues_the_same_protocol_in_its_half_whatever_its_number(world):
    # Why a per-call graph (kernels/gpu/call_graphs.py) may stand for a later eager call in the
    # same buffer half, on any rank while the others run eagerly: what the call queues depends
    # on its half, never on how many calls came before it.
    for name in sorted({name for sequence in SEQUENCES.values() for name in sequence}):
        per_call = _per_call_protocols(name, world)
        assert per_call[0] == per_call[2] and per_call[1] == per_call[3], name
        assert per_call[0] != per_call[1], name  # the halves' flags differ


def test_a_flag_value_that_counts_calls_is_caught(monkeypatch):
    # planted: data flags raised to the call's number (as the fused reductions' barrier does,
    # which is why those never replay)
    signal = symm.GroupRuntime.signal
    monkeypatch.setattr(symm.GroupRuntime, "signal", lambda self, stream, dst, index, value:
                        signal(self, stream, dst, index, self.epoch))
    per_call = _per_call_protocols("rs ce_push:1", 2)
    assert per_call[0] != per_call[2]
