"""Replayed calls keep the cross-rank protocol and the watchdog's view (kernels/gpu/host_replay.py), on
the CPU: every rank's calls, recorded then replayed through native_fakes, run through the protocol
simulator (no deadlock, no race, flags at rest), and with the watchdog on each replayed call still
ends with its own number in its end mark, after every wait, with every wait recorded."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda
from native_fakes import entry_points
from protocol_sim import simulate
from test_protocol_sim import SEQUENCES, _call
from test_watchdog_marks import _mark, fake_watchdog

from torch_commopt.core import env
from torch_commopt.kernels.gpu import driver, host_replay, watchdog

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the native replay")
REPEATS = 8  # per name: each buffer half's first call, two recordings, then replays


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(host_replay, "_kinds", {})
    monkeypatch.setattr(host_replay, "_state", {"lib": None, "why": None, "handles": {}, "workspaces": []})
    monkeypatch.setattr(host_replay, "STATS", {"python": 0, "recorded": 0, "replayed": 0})
    monkeypatch.setattr(host_replay, "blas_handle", lambda stream, dtype, device: 1)


def _bf16(name: str, world: int):
    """test_protocol_sim's call with bf16 tensors (the replay's GEMMs are bf16 / fp16)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return _call(name, world)
    finally:
        torch.set_default_dtype(saved)


def _replayed_queue(world: int, names: list[str], watched: bool = False) -> tuple[list, list, list]:
    """(queue, runtimes, per rank the queue index span of each call) with every name called REPEATS
    times on every rank, the replay on."""
    runtimes, queue, gemms = fake_runtimes(world), [], []
    spans: dict[int, list] = {r: [] for r in range(world)}
    with faked_cuda(runtimes, queue) as active:
        os.environ[env.HOST_REPLAY] = "1"
        os.environ[env.WATCHDOG] = "1" if watched else "0"
        points, keep = entry_points(driver._lib(), gemms)
        host_replay.load(points)
        for name in names:
            calls = [_bf16(name, world) for _ in range(world)]  # each rank's tensors, kept: one kind
            for _ in range(REPEATS):
                for rank in range(world):
                    active(rank)
                    first = len(queue)
                    calls[rank]()
                    spans[rank].append((first, len(queue)))
    del keep
    return queue, runtimes, spans


@pytest.mark.parametrize("tokens_on_side", [False, True])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence", sorted(SEQUENCES))
def test_replayed_calls_neither_deadlock_nor_race_and_come_to_rest(fresh, world, sequence, tokens_on_side, monkeypatch):
    if tokens_on_side:
        monkeypatch.setenv(env.TOKENS_ON_SIDE, "1")
    queue, runtimes, _ = _replayed_queue(world, SEQUENCES[sequence])
    # at W > 2 the reductions allocate their staging and sum their slots: only all-gathers replay there
    if world == 2 or any(name.startswith("ag") for name in SEQUENCES[sequence]):
        assert host_replay.STATS["replayed"] > 0, host_replay._kinds
    for seed in range(4):
        simulate(queue, runtimes, seed)
    assert all(not rt._untaken for rt in runtimes)


def test_a_replayed_call_ends_with_its_own_number_after_its_waits_and_lists_them(fresh, monkeypatch):
    dog = fake_watchdog(monkeypatch)
    world = 2
    queue, runtimes, spans = _replayed_queue(world, ["ag ce_push:1:par=1", "rs ce_pull:2", "rs direct:1"], watched=True)
    assert host_replay.STATS["replayed"] >= 3 * world * (REPEATS - 6)
    for rank in range(world):
        compute, base = runtimes[rank].compute.cuda_stream, runtimes[rank].flag_bases[rank]
        numbers = []
        for lo, hi in spans[rank]:
            ops = queue[lo:hi]
            marks = [(i, _mark(op[1]), op[2]) for i, (_, s, op) in enumerate(ops)
                     if op[0] == "write" and _mark(op[1]) is not None]
            assert [word for _, (_, word), _ in marks] == [watchdog.DONE]
            (end, (slot, _), number), = marks
            on_compute = [i for i, (_, s, _) in enumerate(ops) if s == compute]
            assert on_compute[-1] == end and ops[end][1] == compute
            waits = sorted((op[1], op[2]) for _, _, op in ops if op[0] == "wait")
            call = dog.eager[slot].ring[number % watchdog.EAGER_KEPT]
            assert call.value == number
            assert sorted((base + 4 * w.index, w.value) for w in call.wait_list()) == waits
            numbers.append(number)
        assert numbers == list(range(1, len(numbers) + 1))
