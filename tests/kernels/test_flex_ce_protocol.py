"""The flex all-gather's copy-engine K/V moves (kernels/attention/ce_gather.py) on the CPU: each
rank's real host code runs with CUDA faked (fake_cuda.py), and what it queued -- token takes, DMAs
into peers' slots, data flags, the copies and the sum out of the slots, the releases -- is run by
protocol_sim.py in several interleavings of every rank's streams: no deadlock, no DMA into a slot
a peer still reads, no read of a piece before it landed, every flag back at rest.  Gathers and
sums back to back (both buffer halves reused), and between the matmul schedules' calls, which
share the buffers, flags and tokens; planted bugs (a sum that does not wait for its pieces, a
call that gives no token back) are caught."""

from __future__ import annotations

import types

import pytest
import torch
from fake_cuda import _tensor_rows, fake_runtimes, faked_cuda
from protocol_sim import Deadlock, NotAtRest, Race, simulate

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.attention import ce_gather
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


def _call(name: str, world: int):
    gen = torch.Generator().manual_seed(len(name) + world)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    if name == "gather":
        k, v = rnd(B, H, L, D), rnd(B, H, L, D)
        return lambda: ce_gather.all_gather_kv(k, v, GROUP)
    if name == "scatter":
        gk, gv = rnd(B, H, world * L, D), rnd(B, H, world * L, D)
        return lambda: ce_gather.reduce_scatter_kv(gk, gv, GROUP)
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
            for name in names:  # every rank queues the call, then the next: the GPUs run them later
                for rank in range(world):
                    switch(rank)
                    _call(name, world)()
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
