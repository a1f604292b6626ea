"""The GPU-wait watchdog's decisions (kernels/gpu/watchdog.py) with hand-written slots: the GPU's
marks are written here as its stream memory operations would write them, the clock is the test's.
The GPU side (marks written by a stream, a stuck wait released, the exception in the caller) is
tests/gpu/test_watchdog_gpu.py."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

from torch_commopt.kernels.gpu import watchdog
from torch_commopt.kernels.gpu.watchdog import BUSY, DONE, SEEN, TICKET, Call, Slots, Wait, WaitTimeout, Watchdog

KINDS = ["eager", "captured"]


class FakeRuntime:
    """What the watchdog asks of a GroupRuntime."""

    def __init__(self, flags: list[int] | None, idle: bool = False):
        self.flags, self.idle = flags, idle
        self.closed: str | None = None
        self.released: list[tuple[int, int]] = []
        self.group_name = "g0"

    def read_flags(self):
        return None if self.flags is None else list(self.flags)

    def release(self, index: int, value: int) -> None:
        self.released.append((index, value))
        self.flags[index] = value

    def close(self, message: str) -> None:
        self.closed = message

    def stream_idle(self, handle: int) -> bool:
        return self.idle

    def read_status(self):
        return None if self.flags is None else self.flags[-6:]  # (the real status: 6 words of the flag array)

    def status_message(self, words, op):
        return f"commopt {op}: gave up waiting for code {words[1]} from rank {words[2]}"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def dog():
    words = (ctypes.c_int32 * (watchdog.MAX_SLOTS * watchdog.WORDS))()
    clock = Clock()
    d = Watchdog(Slots(ctypes.addressof(words), 0), timeout_s=10.0, poll_s=0.1, clock=clock)
    d.words_keepalive, d.test_clock = words, clock
    return d


def _begin(d: Watchdog, rt, call: Call, lane: str = "") -> int:
    """What GroupRuntime.begin_call queues for a captured call, done by 'the GPU' at once: ticket,
    seen = 0, busy = 1."""
    call.captured = True
    slot = d.slot_for(rt, 0x1234, lane)
    d.slots.put(slot, TICKET, d.ticket(call))
    d.slots.put(slot, SEEN, 0)
    d.slots.put(slot, BUSY, 1)
    return slot


def _issue(d: Watchdog, rt, call: Call, lane: str = ""):
    """What GroupRuntime.begin_call does for an eager call: nothing queued, the call counted."""
    es = d.eager_slot(rt, 0x1234, lane)
    call.end = es.done
    call.value = es.add(call)
    return es


def _start(d: Watchdog, rt, call: Call, kind: str, lane: str = "") -> None:
    (_issue if kind == "eager" else _begin)(d, rt, call, lane)


class Caller:
    """A thread running Python until a WaitTimeout reaches it (the program that issued the call)."""

    def __init__(self):
        self.caught: list[BaseException] = []
        ready = threading.Event()

        def run():
            ready.set()
            try:
                while True:
                    time.sleep(0.001)
            except WaitTimeout as e:
                self.caught.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait()

    def result(self) -> list[BaseException]:
        self.thread.join(5)
        return self.caught


def _call(rt, thread: int = 0, waits=None, captured: bool = False) -> Call:
    return Call("matmul_rs", "fused:2:store=direct", "g0", 0, 7, thread, rt, 0x1234,
                waits=list(waits or []), captured=captured)


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_stuck_past_the_timeout_is_named_closed_and_released(dog, kind):
    flags = [0] * 64
    flags[10] = 1  # the first wait is satisfied, the second (from rank 1, chunk 3) is not
    rt = FakeRuntime(flags)
    if kind == "eager":  # two calls before it ended: the oldest one pending is named
        es = _issue(dog, rt, _call(rt, waits=[Wait(9, 1, 1, "partial", 0)]))
        dog.slots.put(es.slot, DONE, 1)
    call = _call(rt, waits=[Wait(10, 1, 1, "partial", 0), Wait(11, 1, 1, "partial", 3), Wait(12, 5, 1, "tiles", 3)])
    _start(dog, rt, call, kind)
    if kind == "eager":
        _issue(dog, rt, _call(rt, waits=[Wait(13, 1, 1, "partial", 0)]))  # queued behind it
    dog.poll_once()  # first sight: noted, not judged
    dog.test_clock.now += 9.5
    assert dog.poll_once() == [] and rt.closed is None  # under the bound: a slow peer, not a stuck one
    dog.test_clock.now += 1.0
    caller = Caller()
    call.thread = caller.thread.ident
    messages = dog.poll_once()
    caught = caller.result()
    assert len(caught) == 1 and str(caught[0]) == rt.closed  # the message, in the issuing thread
    assert rt.closed is not None
    message = rt.closed
    for part in ("matmul_rs", "fused:2:store=direct", "group g0", "rank 0", "10 s", "partial from rank 1",
                 "chunk 3", "flag 0, awaited >= 1", "1 more waits", "later call raises"):
        assert part in message, (part, message)
    assert rt.released == [(11, 1), (12, 5)]  # only the pending waits, with the values awaited
    assert len(messages) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_data_wait_is_named_before_a_token_taken_after_it_passed(dog, kind):
    """A token reads 0 once the call passed its wait and took it: the pending data wait is the stall."""
    rt = FakeRuntime([0] * 16)
    caller = Caller()
    _start(dog, rt, _call(rt, thread=caller.thread.ident,
                          waits=[Wait(2, 1, 1, "free buffer", -1, token=True), Wait(5, 1, 1, "partial", 0)]), kind)
    dog.poll_once()
    dog.test_clock.now += 11
    dog.poll_once()
    assert len(caller.result()) == 1
    assert "for partial from rank 1, chunk 0" in rt.closed and "1 more waits" in rt.closed, rt.closed


def test_calls_that_keep_turning_over_are_never_stuck(dog):
    """Captured: busy stays raised across polls, but each new call clears seen: the clock restarts.
    Eager: a call is always pending, but DONE moves between polls."""
    rt = FakeRuntime([0] * 16)
    for i in range(50):
        slot = _begin(dog, rt, _call(rt, waits=[Wait(3, 1, 1, "chunk", 0)]), lane="captured")
        es = _issue(dog, rt, _call(rt, waits=[Wait(4, 1, 1, "chunk", 0)]))
        _issue(dog, rt, _call(rt, waits=[Wait(4, 2, 1, "chunk", 0)]))
        dog.slots.put(es.slot, DONE, 2 * i + 1)  # the first of the two ended
        dog.poll_once()
        dog.test_clock.now += 5.0  # 250 s in all, each call 5 s
    assert rt.closed is None and rt.released == []
    assert dog.slots.get(slot, SEEN) == 1 and es.noted == 99


def test_an_eager_slot_whose_calls_all_ended_is_not_watched(dog):
    rt = FakeRuntime([0] * 16)
    for _ in range(3):
        es = _issue(dog, rt, _call(rt, waits=[Wait(3, 1, 1, "chunk", 0)]))
    dog.slots.put(es.slot, DONE, 3)
    for _ in range(3):
        dog.poll_once()
        dog.test_clock.now += 30
    assert rt.closed is None and es.noted == -1


def test_an_eager_call_whose_end_was_never_queued_is_not_a_stuck_wait(dog):
    rt = FakeRuntime([0] * 16, idle=True)  # its stream has nothing left to run
    _issue(dog, rt, _call(rt, waits=[Wait(3, 1, 1, "chunk", 0)]))
    dog.poll_once()
    dog.test_clock.now += 30
    assert dog.poll_once() == [] and rt.closed is None and rt.released == []


def test_an_eager_call_whose_record_the_ring_let_go_closes_the_group(dog):
    rt = FakeRuntime([0] * 16)
    es = _issue(dog, rt, _call(rt, waits=[Wait(3, 1, 1, "chunk", 0)]))
    for _ in range(watchdog.EAGER_KEPT):  # the host ran a whole ring ahead of the stuck call
        _issue(dog, rt, _call(rt))
    assert es.ring[1 % watchdog.EAGER_KEPT].value == 1 + watchdog.EAGER_KEPT
    dog.poll_once()
    dog.test_clock.now += 11
    assert dog.poll_once() == [] and "its record is gone" in rt.closed and rt.released == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_closed_runtime_releases_later_calls_at_once_and_raises_once(dog, kind):
    rt = FakeRuntime([0] * 16)
    caller = Caller()
    first = _call(rt, thread=caller.thread.ident, waits=[Wait(3, 1, 1, "chunk", 0)])
    _start(dog, rt, first, kind)
    dog.poll_once()
    dog.test_clock.now += 11
    dog.poll_once()
    caught = caller.result()
    assert len(caught) == 1 and "chunk from rank 1" in str(caught[0])
    # a call queued before the close: released at its second sight, no new message, no second raise
    later = _call(rt, thread=threading.get_ident(), waits=[Wait(4, 1, 1, "chunk", 1)], captured=True)
    _begin(dog, rt, later, lane="x")
    dog.poll_once()
    dog.test_clock.now += 0.1
    assert dog.poll_once() == []
    assert (4, 1) in rt.released


@pytest.mark.parametrize("kind", KINDS)
def test_unreadable_flags_still_close_and_release_every_wait(dog, kind):
    rt = FakeRuntime(None)
    rt.release = lambda index, value: rt.released.append((index, value))
    caller = Caller()
    _start(dog, rt, _call(rt, thread=caller.thread.ident, waits=[Wait(3, 1, 1, "chunk", 0), Wait(4, 1, 1, "chunk", 1)]),
           kind)
    dog.poll_once()
    dog.test_clock.now += 11
    dog.poll_once()
    assert len(caller.result()) == 1
    assert "could not be read" in rt.closed
    assert rt.released == [(3, 1), (4, 1)]


def test_wrap_around_compare_matches_the_gpu():
    assert watchdog._after(5, 5) and watchdog._after(6, 5) and not watchdog._after(4, 5)
    assert watchdog._after(-2**31, 2**31 - 1)  # one past the largest int32 is after it
    assert not watchdog._after(2**31 - 1, -2**31)


def test_eager_numbers_count_per_slot_and_captured_tickets_are_kept(dog):
    rt = FakeRuntime([0])
    numbers = [_issue(dog, rt, c := _call(rt)) and c.value for _ in range(3)]
    other = _call(rt)
    _issue(dog, rt, other, lane="ring1")
    kept = dog.ticket(_call(rt, captured=True))
    assert numbers == [1, 2, 3] and other.value == 1 and kept == watchdog.CAPTURED
    for _ in range(watchdog.MAX_CAPTURED):
        dog.ticket(_call(rt, captured=True))
    assert kept not in dog.calls and len(dog.calls) == watchdog.MAX_CAPTURED  # bounded: the oldest went


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_over_several_flags_names_its_peer_and_releases_every_flag(dog, kind):
    # the one-shot all-reduce's barrier: one wait per peer and barrier, over every block's flag
    # (stride apart); blocks 0 and 2 arrived, block 1 and 3 did not
    flags = [0] * 64
    flags[4], flags[4 + 2 * 8] = 1, 1
    rt = FakeRuntime(flags)
    call = _call(rt, waits=[Wait(4, 1, 1, "ll barrier", token=True, stride=8, count=4)])
    _start(dog, rt, call, kind)
    dog.poll_once()
    dog.test_clock.now += 11.0
    caller = Caller()
    call.thread = caller.thread.ident
    dog.poll_once()
    assert len(caller.result()) == 1 and "ll barrier from rank 1" in rt.closed, rt.closed
    assert rt.released == [(12, 1), (28, 1)]  # every flag of the wait still down, no other


def test_a_self_bounded_call_that_gave_up_closes_the_group_and_raises_once(dog):
    # the low-latency collectives mark no call: their spins give up after the bound and record it in
    # the status words, which the watchdog reads at every poll
    flags = [0] * 64
    rt = FakeRuntime(flags)
    caller = Caller()
    dog.watch_status(rt, "one-shot all-reduce")
    dog.bounded[id(rt)][1] = caller.thread.ident  # (registered by the issuing thread in real use)
    assert dog.poll_once() == [] and rt.closed is None  # nothing recorded: nothing said
    flags[-6:] = [1, 9, 1, 0, 0, 1]  # a spin gave up: code 9, peer 1
    found = dog.poll_once()
    assert len(found) == 1 and "one-shot all-reduce" in found[0] and "from rank 1" in found[0], found
    assert "results are garbage" in found[0] and rt.closed == found[0]
    assert len(caller.result()) == 1 and str(caller.caught[0]) == found[0]  # in the issuing thread
    assert dog.poll_once() == []  # closed: said once
    assert rt.released == []  # the kernel ended by itself: nothing to release
