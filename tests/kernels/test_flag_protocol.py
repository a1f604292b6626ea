"""The flag protocol's stream memory operations as symm.GroupRuntime queues them, with the
driver recorded instead of called (no CUDA): which flag each operation touches, in which order,
and how they are batched.  The GPU tests run the same protocol between two GPUs."""

from __future__ import annotations

import pytest

from torch_commopt.kernels.gpu import driver, symm

FLAG_BASES = [0x10000000, 0x20000000, 0x30000000, 0x40000000]


def _runtime(rank: int, world: int) -> symm.GroupRuntime:
    rt = object.__new__(symm.GroupRuntime)  # the protocol's fields only: no CUDA, no rendezvous
    rt.rank, rt.world, rt.epoch, rt.group_name = rank, world, 0, "test"
    rt.peers = [(rank + s) % world for s in range(1, world)]
    rt.sources = [(rank - s) % world for s in range(1, world)]
    rt.flag_bases, rt._untaken = FLAG_BASES[:world], {}
    return rt


@pytest.fixture
def queued(monkeypatch):
    """Every stream memory operation queued, as (stream, kind, rank, flag index, value);
    a batch as one entry ("batch", [its operations])."""
    log = []

    def where(address):
        rank = max(r for r, base in enumerate(FLAG_BASES) if address >= base)
        return rank, (address - FLAG_BASES[rank]) // 4

    monkeypatch.setattr(driver, "wait_value32", lambda s, a, v: log.append((s, "wait", *where(a), v)))
    monkeypatch.setattr(driver, "write_value32", lambda s, a, v: log.append((s, "write", *where(a), v)))

    def batch(stream, ops, last=None):
        ops = list(ops)
        if len(ops) > driver.MAX_BATCH:
            raise ValueError("too many")
        if last is not None:  # the last operation's value, given apart (driver.batch)
            ops[-1] = (*ops[-1][:2], last)
        log.append((stream, "batch", [(kind, *where(a), v) for kind, a, v in ops]))
    monkeypatch.setattr(driver, "batch", batch)
    return log


def _free(half: int, peer: int) -> int:
    return symm.FREE + half * symm.MAX_WORLD + peer


@pytest.mark.parametrize("half", [0, 1])
def test_a_deferred_take_rides_on_the_first_signal(queued, half):
    rt = _runtime(rank=1, world=3)
    rt.acquire("side", 2, half, debug=False, defer_take=True)
    rt.signal("side", 2, symm.data_index(half, 1, 0), 1)
    rt.signal("side", 2, symm.data_index(half, 1, 1), 1)  # later pieces: plain signals
    assert queued == [
        ("side", "wait", 1, _free(half, 2), 1),
        ("side", "batch", [("write", 1, _free(half, 2), 0), ("write", 2, symm.data_index(half, 1, 0), 1)]),
        ("side", "write", 2, symm.data_index(half, 1, 1), 1),
    ]


def test_an_immediate_take_follows_the_wait(queued):
    rt = _runtime(rank=0, world=2)
    rt.acquire("cur", 1, 1, debug=False)
    assert queued == [("cur", "wait", 0, _free(1, 1), 1), ("cur", "write", 0, _free(1, 1), 0)]
    rt.signal("cur", 1, symm.data_index(1, 0, 0), 1)  # the fused paths' signals: no batch
    assert queued[-1] == ("cur", "write", 1, symm.data_index(1, 0, 0), 1)


@pytest.mark.parametrize("world,chunks,phases", [(2, 1, 1), (4, 3, 2), (4, 100, 1)])
def test_done_reading_lowers_every_flag_before_any_token_goes_back(queued, world, chunks, phases):
    rt = _runtime(rank=world - 1, world=world)
    rt.done_reading("cur", 1, chunks, phases=phases)
    batches = [entry for entry in queued if entry[1] == "batch"]
    assert len(batches) == len(queued) == -(-((world - 1) * (chunks * phases + 1)) // driver.MAX_BATCH)
    ops = [op for _, _, batch in batches for op in batch]
    lowered = {(src, symm.data_index(1, src, c, phase)) for src in rt.sources for c in range(chunks)
               for phase in range(phases)}
    tokens = [("write", src, _free(1, rt.rank), 1) for src in rt.sources]
    assert ops[-len(tokens):] == tokens  # the tokens last, after every lowering
    assert {(index, v) for _, rank, index, v in ops[:-len(tokens)] if rank == rt.rank} == \
        {(index, 0) for _, index in lowered}
    assert len(ops) == len(lowered) + len(tokens)


def test_a_deferred_take_no_signal_made_is_refused(queued):
    rt = _runtime(rank=0, world=2)
    rt.acquire("side", 1, 0, debug=False, defer_take=True)
    with pytest.raises(RuntimeError, match=r"acquired the tokens of peers \[1\] and never took them"):
        rt.done_reading("cur", 0, 1)
    rt.done_reading("cur", 0, 1)  # the refusal cleared it


def test_a_new_call_forgets_a_failed_calls_deferred_take(queued):
    rt = _runtime(rank=0, world=2)
    rt.acquire("side", 1, 0, debug=False, defer_take=True)
    rt.next_epoch()  # the call raised before its signal; the next one starts clean
    rt.signal("side", 1, symm.data_index(1, 0, 0), 1)
    assert queued[-1] == ("side", "write", 1, symm.data_index(1, 0, 0), 1)


def test_batch_parameters_are_built_once_and_hold_the_ops():
    # driver.batch reuses one ctypes array per distinct batch (the host cost of filling it was most
    # of batch's time); the array must hold exactly the ops, masked to 32 bits, and bad batches
    # must still raise before anything reaches the driver
    ops = (("wait", 0x1000, 3), ("write", 0x2004, (1 << 32) + 5))
    params = driver._batch_params(ops)
    assert driver._batch_params(tuple(ops)) is params
    assert [(p.operation, p.address, p.value, p.flags) for p in params] == [
        (driver._OP_WAIT32, 0x1000, 3, driver.WAIT_GEQ), (driver._OP_WRITE32, 0x2004, 5, driver.WRITE_FENCED)]
    with pytest.raises(ValueError, match="unknown stream memory operation"):
        driver._batch_params((("add", 0x1000, 1),))
    with pytest.raises(ValueError, match="at most"):
        driver._batch_params((("write", 0x1000, 1),) * (driver.MAX_BATCH + 1))


def test_a_batch_whose_last_value_changes_every_call_reuses_its_array(monkeypatch):
    # the watchdog's eager end mark (an eager call's number) rides on done_reading's batch: the value
    # is set in the cached array before each call, not a new cached array per number
    seen = []
    monkeypatch.setattr(driver, "_lib", lambda: {"cuStreamBatchMemOp": lambda s, n, params, f: seen.append(
        (params, [(p.address, p.value) for p in params[:n]])) or 0})
    ops = [("write", 0x3000, 0), ("write", 0x4000, 0)]
    for number in (7, 8, (1 << 32) + 9):
        driver.batch(0x55, ops, last=number)
    assert [v for _, v in seen] == [[(0x3000, 0), (0x4000, 7)], [(0x3000, 0), (0x4000, 8)], [(0x3000, 0), (0x4000, 9)]]
    assert seen[0][0] is seen[1][0] is seen[2][0]  # one cached array
