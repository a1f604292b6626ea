"""Where the GPU schedules put the watchdog's marks (kernels/gpu/watchdog.py), on the CPU: each rank's
real host code runs with CUDA faked (fake_cuda.py) and the watchdog on.  A captured call's start
batch (ticket, seen = 0, busy = 1) comes before anything the call queues on its stream and its end
mark (busy = 0) after, every wait of the call lies between them; an eager call queues no start mark
and its end mark (the call's number into DONE) is the last thing it queues on its stream, after
every wait there.  The watchdog's record of the call lists every wait the call queued, on any stream,
with the value awaited.  (A start mark forked onto a stream of its own measured slower in replays:
benchmarks/bench_watchdog.py.)"""

from __future__ import annotations

import ctypes
import os

import pytest
from fake_cuda import fake_runtimes, faked_cuda
from test_protocol_sim import SEQUENCES, _call

from torch_commopt.core import env
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import symm, watchdog
from torch_commopt.kernels.matmul.gpu.matmul_reduce import pull_placed

MARKS = 1 << 45  # the fake device address of the host-mapped slots


def fake_watchdog(monkeypatch) -> watchdog.Watchdog:
    """The process's watchdog, its slots in host memory at the fake device address MARKS."""
    words = (ctypes.c_int32 * (watchdog.MAX_SLOTS * watchdog.WORDS))()
    d = watchdog.Watchdog(watchdog.Slots(ctypes.addressof(words), MARKS), timeout_s=60.0)
    d.keep = words
    monkeypatch.setattr(watchdog, "get", lambda: d)
    return d


@pytest.fixture
def dog(monkeypatch):
    return fake_watchdog(monkeypatch)


def _mark(address: int) -> tuple[int, int] | None:
    """(slot, word) of a mark's address, None for any other address."""
    offset = address - MARKS
    if 0 <= offset < watchdog.MAX_SLOTS * watchdog.WORDS * 4:
        return divmod(offset // 4, watchdog.WORDS)
    return None


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", ["ag", "reductions", "outer blocks", "k parts"])
def test_every_wait_of_a_call_lies_between_its_marks_and_is_recorded(dog, world, sequence, captured, monkeypatch):
    names = SEQUENCES[sequence]
    runtimes, queue = fake_runtimes(world), []
    monkeypatch.setattr(symm, "capturing", lambda: captured)
    with faked_cuda(runtimes, queue) as active:
        os.environ[env.WATCHDOG] = "1"  # faked_cuda turns it off for the protocol tests
        spans: dict[int, list[tuple[int, int]]] = {r: [] for r in range(world)}  # queue index range per call
        for name in names:
            for rank in range(world):
                active(rank)
                first = len(queue)
                _call(name, world)()
                spans[rank].append((first, len(queue)))
    for rank in range(world):
        compute = runtimes[rank].compute.cuda_stream
        numbers = []
        for (lo, hi), name in zip(spans[rank], names):
            ops = queue[lo:hi]
            marks = [(i, _mark(op[1]), op[2]) for i, (r, s, op) in enumerate(ops)
                     if op[0] == "write" and _mark(op[1]) is not None]
            assert all(ops[i][1] == compute for i, _, _ in marks), name  # on the caller's stream
            on_compute = [i for i, (_, s, _) in enumerate(ops) if s == compute]
            waits = [(i, op) for i, (_, s, op) in enumerate(ops) if op[0] == "wait"]
            if captured:
                busy = [(i, v) for i, (slot, word), v in marks if word == watchdog.BUSY]
                assert [v for _, v in busy] == [1, 0], (name, marks)
                start, end = busy[0][0], busy[1][0]
                assert on_compute[0] <= start, name  # first on the stream
                ticket = [v for _, (slot, word), v in marks if word == watchdog.TICKET][0]
                call = dog.calls[ticket]
            else:
                assert [word for _, (slot, word), _ in marks] == [watchdog.DONE], (name, marks)  # no start mark
                (end, (slot, _), number), start = marks[0], -1
                call = dog.eager[slot].ring[number % watchdog.EAGER_KEPT]
                numbers.append(number)
                assert call.value == number, name
            assert on_compute[-1] == end, name  # the end mark: last on the stream
            assert all(start < i < end for i, _ in waits if ops[i][1] == compute), name
            base = runtimes[rank].flag_bases[rank]
            recorded = sorted((base + 4 * w.index, w.value) for w in call.wait_list())
            queued = sorted((op[1], op[2]) for _, op in waits)
            assert recorded == queued, (name, recorded, queued)
            assert call.captured == captured, name
            ran = pull_placed(Schedule.parse(name.split()[1]), world, call.op)  # ce_pull: two ranks only
            assert call.op in ("ag_matmul", "matmul_rs", "matmul_ar") and call.schedule == ran, name
        assert numbers == list(range(1, len(numbers) + 1))  # one sequence per slot, every call counted
