"""Bounded GPU waits in production: a watchdog over the symmetric runtime's calls.

A GPU schedule's call waits for its peers on the GPU (cuStreamWaitValue32 on the copy-engine
paths, spins inside the fused Triton kernels).  Without a bound, a peer that died or runs
something else stalls the program forever.  NCCL's answer is a watchdog thread that turns a
collective stuck past a timeout into an error; this is ours, at a cost that does not touch the
kernels:

Two kinds of marks, both stream memory operations into host-mapped pinned memory (one *slot* of
WORDS int32 words per runtime, stream and lane), which one thread per process reads every `poll`
seconds from host memory, no CUDA call:

- An **eager call** (the host issues it now) costs one write: at its end, on the caller's stream,
  its number in the slot's sequence goes into the slot's DONE word (riding on the call's last batch
  of flag writes where it has one, GroupRuntime.done_reading).  The host knows how many calls it
  issued (`EagerSlot.issued`, a Python int), so a slot whose DONE lags is *pending*: its oldest
  unfinished call is DONE + 1, its record in the slot's ring.  The thread notes the time when it
  first sees a slot pending at some DONE value; DONE still there after the timeout means that call
  has not finished all that time.  As NCCL's watchdog, the time counts from when the call could
  start (its predecessor on the slot done, at the poll's resolution), not from when its first
  kernel ran: a stream busy with a minute of other work queued between two calls would read as
  stuck, which no real program does.  No start mark: that batch and its bookkeeping were most of
  the watchdog's cost on the host-bound eager calls (benchmarks/results/watchdog_overhead_*.md).
- A **captured call** (ours per call, or Inductor's graph trees) brackets its work with a start
  batch (its ticket, `seen` = 0, `busy` = 1) and an end write (`busy` = 0): the host does not see
  a graph's replays, so the GPU must say when one starts.  A slot busy with `seen` clear is a call
  the thread has not seen yet: it sets `seen` and notes the time.  A new call clears `seen` again,
  so `seen` still set while `busy` is raised means the same call has been running since the note:
  past the timeout it is stuck.  (A host write racing a call's end and the next call's start marks
  the *next* call, from about its own start: never an old call's time.)
- A stuck call (`expire`): the thread reads this rank's flags (a device-to-host copy on a stream
  of its own: the copy engine, not the stuck stream), names the first wait of the call that is
  not satisfied -- what, from which peer, the flag's value and the value awaited --, closes the
  runtime with that message (every later call of the group raises `WaitTimeout` at once), raises
  `WaitTimeout` asynchronously in the thread that issued the call, and then writes the awaited
  values into this rank's flags so that the stuck stream and kernels run to their end (the
  call's results are garbage; the exception says so) and the GPU is usable again.  While the
  runtime is closed, calls queued before the close are released the same way without waiting.

Kernels that bound their own spins (the low-latency collectives, kernels/gpu/lowlat.py: a
decode all-reduce takes a few microseconds, less than the two marks would cost a replayed call;
docs/gpu-schedules.md) are not marked per call.  Each spin gives up after the timeout in wall
time (waits.spin_geq, the same bound as debug mode) and records what it waited for in the
runtime's status words; the call's issuer registers the runtime once (`watch_status`), and the
thread reads those words with the flags' copy at every poll: a timeout found there closes the
runtime and raises in the issuer's thread as a stuck call does.  The kernels have already ended,
so nothing needs releasing.

The asynchronous exception (`PyThreadState_SetAsyncExc`) fires when that thread next runs Python
bytecode: at once if it runs, or when a blocking CUDA call it is in returns once the waits are
released.  The runtime's later calls raise on their own (`GroupRuntime.begin_call`).

Cost per call: eager, a number in a batch the call queues anyway (or one write) and a few
microseconds of Python; captured, the start batch (on the GPU's front end ~3.5 us a replay), measured
in benchmarks/results/watchdog_overhead_*.md.  TORCH_COMMOPT_WATCHDOG=0 turns it off,
TORCH_COMMOPT_WAIT_TIMEOUT_S sets the bound (default 60 s).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch_commopt.core import env

log = logging.getLogger("torch_commopt.kernels.gpu.watchdog")

WORDS = 4  # int32 words per slot
TICKET, SEEN, BUSY, DONE = 0, 1, 2, 3  # a captured call's marks; DONE: the last eager call that ended
MAX_SLOTS = 256
EAGER_KEPT = 1 << 12  # records of eager calls kept per slot (a ring): far more than a host runs ahead of its GPU
CAPTURED = 1 << 30  # tickets of captured calls start here and are kept while the process lives
MAX_CAPTURED = 1 << 16


class WaitTimeout(RuntimeError):
    """A GPU wait of a commopt call did not end within its bound: a peer stalled, crashed, or runs
    a different schedule.  The group's runtime is closed afterwards: every later call raises."""


@dataclass(slots=True)
class Wait:
    index: int  # this rank's flag (int32 index into its flag array)
    value: int  # awaited: flag >= value (wrap-around compare)
    src: int  # the rank that should raise it (-1: none in particular)
    what: str
    chunk: int = -1
    token: bool = False  # a token wait: the call takes the flag back to 0 once it has passed
    # more flags of the same wait, released with it: index + k * stride for k < count (the
    # low-latency kernels' per-block barrier flags, told as one wait per peer and barrier)
    stride: int = 0
    count: int = 1


@dataclass(slots=True, eq=False)
class Call:
    """What the watchdog knows of one call: enough to name it and to release its waits."""

    op: str
    schedule: object  # the Schedule (or a label): str() only when the call is named
    group: str
    rank: int
    epoch: int
    thread: int  # threading.get_ident() of the issuing thread
    runtime: object  # the GroupRuntime: read_flags(), read_status(), status_message(), release(), close(), closed
    stream: int = 0  # the caller's stream (raw handle) the call's marks are queued on
    # its waits: Wait, or the tuple of a Wait's fields (what GroupRuntime.expect records: a tuple
    # costs a tenth of a Wait, on every call; the Wait is made when a call is stuck)
    waits: list = field(default_factory=list)
    captured: bool = False
    end: int = 0  # the device address its end mark writes (the slot's BUSY word, or DONE when eager)
    value: int = 0  # what the end mark writes there (0, or the eager call's number)
    ended: bool = False  # the end mark rode on the call's last batch (GroupRuntime.done_reading)

    def wait_list(self) -> list[Wait]:
        return [w if isinstance(w, Wait) else Wait(*w) for w in self.waits]

    def describe(self) -> str:
        kind = "a captured call" if self.captured else f"call #{self.epoch}"
        return f"commopt {self.op} ({self.schedule}), {kind} of group {self.group} on rank {self.rank}"


def _after(value: int, expected: int) -> bool:
    """value >= expected, int32 wrap-around (as the GPU compares)."""
    return ((value - expected) & 0xFFFFFFFF) < 0x80000000


def _flags_of(w: Wait) -> list[int]:
    """The indexes of w's flags: index + k * stride for k < count."""
    return [w.index + k * w.stride for k in range(w.count)]


def _unmet(w: Wait, flags) -> list[int]:
    """The indexes of w's flags not yet at the value awaited."""
    return [i for i in _flags_of(w) if not _after(flags[i], w.value)]


def stuck_message(call: Call, flags, elapsed: float, timeout: float) -> str:
    """The error of a call stuck for `elapsed` seconds: its first unsatisfied wait (by flags, this
    rank's flag values, or None when they could not be read) named."""
    head = f"{call.describe()} waited {elapsed:.0f} s ({env.WAIT_TIMEOUT_S}={timeout:g})"
    if flags is None:
        return f"{head}; its flags could not be read. A peer stalled, crashed, or runs a different schedule."
    pending = [w for w in call.wait_list() if _unmet(w, flags)]
    # A token reads 0 once passed and taken, so a data wait (its flag lowered only after the call's
    # last read) names the stall better; a token is named when no data wait is pending.
    pending.sort(key=lambda w: w.token)
    if not pending:
        return (f"{head}, though every flag it waits for is set (the stall is elsewhere on its streams)."
                " A peer stalled, crashed, or runs a different schedule.")
    w = pending[0]
    where = f" from rank {w.src}" if w.src >= 0 else ""
    chunk = f", chunk {w.chunk}" if w.chunk >= 0 else ""
    index = _unmet(w, flags)[0]
    more = f" ({len(pending) - 1} more waits of the call pending)" if len(pending) > 1 else ""
    return (f"{head} for {w.what}{where}{chunk} (flag {flags[index]}, awaited >= {w.value}){more}: "
            f"rank {w.src if w.src >= 0 else '?'} stalled, crashed, or runs a different schedule. The call's "
            "results are garbage and the group's GPU schedules are closed in this process: every later "
            "call raises this error.")


def raise_in(thread: int, message: str) -> bool:
    """Raise WaitTimeout(message) asynchronously in thread `thread` (when it next runs bytecode)."""
    exc = type("WaitTimeout", (WaitTimeout,), {"__init__": lambda self, *_: WaitTimeout.__init__(self, message)})
    setter = ctypes.pythonapi.PyThreadState_SetAsyncExc
    setter.argtypes = [ctypes.c_ulong, ctypes.py_object]
    return setter(thread, exc) == 1


class Slots:
    """Host-mapped int32 words the GPU writes and the host reads: WORDS per slot."""

    def __init__(self, host: int, device: int, n: int = MAX_SLOTS):
        self.words = (ctypes.c_int32 * (n * WORDS)).from_address(host)
        self.device, self.n = device, n

    def get(self, slot: int, word: int) -> int:
        return self.words[slot * WORDS + word]

    def put(self, slot: int, word: int, value: int) -> None:
        self.words[slot * WORDS + word] = value

    def address(self, slot: int, word: int) -> int:
        """The word's device address (what the GPU's stream memory operations write)."""
        return self.device + 4 * (slot * WORDS + word)


@dataclass(slots=True, eq=False)
class EagerSlot:
    """A slot's eager calls: the issuing side counts them and keeps their records, the GPU writes
    the number of each that ends into the slot's DONE word (module docstring)."""

    slot: int
    runtime: object
    done: int  # the DONE word's device address
    issued: int = 0  # calls issued on the slot (the latest one's number); written by the issuer only
    ring: list = field(default_factory=lambda: [None] * EAGER_KEPT)  # number % EAGER_KEPT -> its Call
    noted: int = -1  # the DONE value the thread saw with calls pending, and since when
    since: float = 0.0

    def add(self, call: Call) -> int:
        """Record the issuer's next call on this slot; its number (what its end mark writes)."""
        number = self.issued + 1
        self.ring[number % EAGER_KEPT] = call
        self.issued = number  # after the record: the thread never sees a number without its call
        return number


class Watchdog:
    """The per-process watchdog (module docstring).  `poll_once` is the whole decision, callable
    with a clock of the caller's (the CPU tests drive it with hand-written slots)."""

    def __init__(self, slots: Slots, timeout_s: float, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.slots, self.timeout, self.clock = slots, timeout_s, clock
        self.poll = poll_s if poll_s is not None else min(1.0, max(0.02, timeout_s / 20))
        self.keys: dict[tuple, int] = {}  # (runtime id, stream handle) -> slot
        self.owner: dict[int, object] = {}  # slot -> its runtime
        self.calls: dict[int, Call] = {}  # ticket -> captured call
        self.eager: dict[int, EagerSlot] = {}  # slot -> its eager calls
        self.next_captured = CAPTURED
        self.since: dict[int, float] = {}  # slot -> when its current call was first seen running
        self.told: set[int] = set()  # runtimes (id) whose failure was raised in a thread already
        self.bounded: dict[int, list] = {}  # runtime id -> [runtime, issuing thread, last label] (watch_status)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    # ---- the calling side ---------------------------------------------------------------------
    def slot_for(self, runtime, stream_handle: int, lane: str = "") -> int | None:
        """The slot of (runtime, stream, lane): calls that may be under way at once on one stream
        (an attention ring's two channels) take lanes of their own."""
        key = (id(runtime), stream_handle, lane)
        slot = self.keys.get(key)
        if slot is None:
            with self.lock:
                if len(self.keys) >= self.slots.n:
                    return None
                slot = self.keys[key] = len(self.keys)
                self.owner[slot] = runtime
        return slot

    def eager_slot(self, runtime, stream_handle: int, lane: str = "") -> EagerSlot | None:
        """The eager calls of (runtime, stream, lane)'s slot (None: no slot left); the caller caches it."""
        slot = self.slot_for(runtime, stream_handle, lane)
        if slot is None:
            return None
        with self.lock:
            es = self.eager.get(slot)
            if es is None:
                es = self.eager[slot] = EagerSlot(slot, runtime, self.slots.address(slot, DONE))
        return es

    def ticket(self, call: Call) -> int:
        """A ticket for captured `call`, remembered (the latest MAX_CAPTURED)."""
        with self.lock:
            ticket = self.next_captured
            self.next_captured += 1
            if ticket - CAPTURED >= MAX_CAPTURED:  # bounded: the oldest captured record goes
                self.calls.pop(ticket - MAX_CAPTURED, None)
            self.calls[ticket] = call
        return ticket

    def watch_status(self, runtime, label: str) -> None:
        """Watch `runtime`'s status words: its self-bounded call `label` (issued by this thread)
        records a timeout there instead of marking its start and end (module docstring)."""
        entry = self.bounded.get(id(runtime))
        if entry is None:
            with self.lock:
                self.bounded[id(runtime)] = [runtime, threading.get_ident(), label]
        else:
            entry[1], entry[2] = threading.get_ident(), label

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="commopt-watchdog", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:  # its flag copies must neither fail nor break a capture running in another thread
            from torch_commopt.kernels.gpu import driver

            driver.relax_capture_mode()
        except Exception:  # noqa: BLE001 - no driver here (the CPU tests' fake runtimes)
            log.debug("commopt: the watchdog thread keeps the default capture mode", exc_info=True)
        while True:
            time.sleep(self.poll)
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one failure
                log.exception("commopt: the GPU-wait watchdog failed once; it keeps watching")

    # ---- the watching side --------------------------------------------------------------------
    def poll_once(self) -> list[str]:
        """One look at every slot; the messages of the calls it found stuck (new ones only)."""
        now, found = self.clock(), []
        for slot in range(len(self.keys)):
            s = self.slots
            if s.get(slot, BUSY) != 1:
                self.since.pop(slot, None)
                continue
            if s.get(slot, SEEN) == 0:
                s.put(slot, SEEN, 1)
                self.since[slot] = now
                continue
            start = self.since.setdefault(slot, now)
            runtime = self.owner[slot]
            if getattr(runtime, "closed", None) is not None or now - start > self.timeout:
                message = self.expire(slot, now - start)
                if message is not None:
                    found.append(message)
        for es in list(self.eager.values()):
            message = self.look_eager(es, now)
            if message is not None:
                found.append(message)
        for runtime, thread, label in list(self.bounded.values()):
            message = self.gave_up(runtime, thread, label)
            if message is not None:
                found.append(message)
        return found

    def look_eager(self, es: EagerSlot, now: float) -> str | None:
        """One look at an eager slot: pending since when, stuck past the timeout (module docstring)."""
        done = self.slots.get(es.slot, DONE) & 0xFFFFFFFF
        pending = (es.issued - done) & 0xFFFFFFFF
        if pending == 0 or pending >= 0x80000000:  # all ended (a number "ahead": a slot's first calls)
            es.noted = -1
            return None
        if es.noted != done:  # first sight of this call pending, or the slot moved on since
            es.noted, es.since = done, now
            return None
        runtime = es.runtime
        if getattr(runtime, "closed", None) is None and now - es.since <= self.timeout:
            return None
        number = es.issued - pending + 1  # the oldest call not ended
        call = es.ring[number % EAGER_KEPT]
        if call is None or (call.value - number) & 0xFFFFFFFF:  # the ring let its record go
            return self.forget(runtime, now - es.since)
        message = self.judge(call, now - es.since)
        es.since = self.clock()  # released (or not stuck): look again after a poll, not at once
        return message

    def forget(self, runtime, elapsed: float) -> None:
        """A stuck call whose record is gone: nothing to name or release; the runtime is closed."""
        if getattr(runtime, "closed", None) is None:
            runtime.close(f"commopt: a call of group {getattr(runtime, 'group_name', '?')} waited "
                          f"{elapsed:.0f} s on the GPU and its record is gone; the group's GPU schedules are closed")
        return None

    def gave_up(self, runtime, thread: int, label: str) -> str | None:
        """A self-bounded call of `runtime` gave up waiting (its status words say so): close the
        runtime and raise in the issuing thread, once.  The message when new."""
        if runtime.closed is not None:
            return None
        words = runtime.read_status()
        if words is None or not words[0]:
            return None
        message = (runtime.status_message(words, label) + f". Its spin gave up after {self.timeout:.0f} s; the "
                   "call's results are garbage and the group's GPU schedules are closed")
        runtime.close(message)
        log.error("%s", message)
        if id(runtime) not in self.told:
            self.told.add(id(runtime))
            raise_in(thread, message)
        return message

    def expire(self, slot: int, elapsed: float) -> str | None:
        """Slot `slot`'s call is stuck (or its runtime closed): name it, close the runtime, raise in
        the issuing thread (once per runtime), release its waits.  The message when new."""
        call = self.calls.get(self.slots.get(slot, TICKET))
        if call is None:  # a record let go: nothing to name or release
            return self.forget(self.owner[slot], elapsed)
        message = self.judge(call, elapsed)
        self.since[slot] = self.clock()  # released (or not stuck): look again after a poll, not at once
        return message

    def judge(self, call: Call, elapsed: float) -> str | None:
        """`call` has not ended for `elapsed` s past the timeout (or its runtime is closed): unless
        it is an eager call whose stream is idle, name it, close the runtime, raise in the issuing
        thread (once per runtime), release its waits.  The message when new."""
        runtime = call.runtime
        if not call.captured and runtime.closed is None and runtime.stream_idle(call.stream):
            # Nothing left to run on the call's stream: its end mark was never queued (the call raised
            # between its start and its end), not a stuck wait.  Watched again after a timeout.
            log.info("%s: its stream is idle but the call never marked its end; not a stuck wait", call.describe())
            return None
        flags = runtime.read_flags()
        new = runtime.closed is None
        message = None
        if new:
            message = stuck_message(call, flags, elapsed, self.timeout)
            runtime.close(message)
            log.error("%s", message)
        if id(runtime) not in self.told:
            self.told.add(id(runtime))
            raise_in(call.thread, runtime.closed)
        for w in call.wait_list():
            for index in (_flags_of(w) if flags is None else _unmet(w, flags)):
                runtime.release(index, w.value)
        return message


_WATCHDOG: Watchdog | None = None
_UNAVAILABLE: list[str] = []  # why the process has no watchdog (tried once)
_LOCK = threading.Lock()
_CAPTURE_WARNED: list[bool] = []


def prepare() -> None:
    """Start the process's watchdog now if it is on (a runtime's creation calls this: outside any
    capture, so a first call made inside one finds it running)."""
    if env.watchdog():
        get()


def get() -> Watchdog | None:
    """The process's watchdog (created and started at the first watched call, with the bound
    TORCH_COMMOPT_WAIT_TIMEOUT_S has then), or None when the host memory for it could not be had
    (logged once; calls then run unwatched).  Never created under a CUDA-graph capture: the host
    allocation is forbidden there and would invalidate the capture (the runtimes make it at their
    creation, outside any capture: prepare()); such a call runs unwatched, with a warning."""
    global _WATCHDOG
    if _WATCHDOG is not None or _UNAVAILABLE:
        return _WATCHDOG
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        if not _CAPTURE_WARNED:
            _CAPTURE_WARNED.append(True)
            log.warning("commopt: a first watched call inside a CUDA-graph capture: the GPU-wait watchdog cannot "
                        "start there; this capture's waits are unwatched")
        return None
    with _LOCK:
        if _WATCHDOG is None and not _UNAVAILABLE:
            from torch_commopt.kernels.gpu import driver

            try:
                host, device = driver.host_mapped(MAX_SLOTS * WORDS * 4)
            except RuntimeError as e:
                _UNAVAILABLE.append(str(e))
                log.warning("commopt: no host-mapped memory for the GPU-wait watchdog (%s); GPU waits are "
                            "unbounded in this process", e)
                return None
            _WATCHDOG = Watchdog(Slots(host, device), env.wait_timeout_s())
            _WATCHDOG.start()
    return _WATCHDOG
