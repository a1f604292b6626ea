"""Symmetric memory is bounded: a byte cap per device refused on one rank is refused on every rank
(NCCL runs there), a purpose's superseded buffer is released on every rank at the same call, and
each buffer's views cache is a bounded LRU dropped with it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from fake_cuda import _Handle
from symm_cap_programs import cap_on_one_rank, supersede

from torch_commopt.core import env
from torch_commopt.kernels.gpu import symm, symm_alloc, symm_cap
from torch_commopt.testing.launch import run_distributed

MIB = 1 << 20


@pytest.mark.parametrize("text,expected", [(None, None), ("", None), (" 512 ", 512.0), ("0", 0.0), ("1.5", 1.5),
                                           ("inf", math.inf)])
def test_the_cap_variable_parses_to_mib(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv(env.SYMM_CAP_MIB, raising=False)
    else:
        monkeypatch.setenv(env.SYMM_CAP_MIB, text)
    assert env.symm_cap_mib() == expected


@pytest.mark.parametrize("text", ["-1", "nan", "lots", "1GiB"])
def test_a_bad_cap_value_is_an_error_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(env.SYMM_CAP_MIB, text)
    with pytest.raises(ValueError, match=env.SYMM_CAP_MIB):
        env.symm_cap_mib()


def test_the_default_cap_is_an_eighth_of_the_device_and_the_variable_overrides_it(monkeypatch):
    monkeypatch.delenv(env.SYMM_CAP_MIB, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=(index + 1) << 37))
    assert symm_cap.cap_bytes(torch.device("cuda", 1)) == (2 << 37) // 8  # 32 GiB of a 256 GiB device
    assert symm_cap.cap_bytes(torch.device("cpu")) is None and symm_cap.cap_bytes(None) is None
    monkeypatch.setenv(env.SYMM_CAP_MIB, "300")
    assert symm_cap.cap_bytes(torch.device("cuda", 1)) == 300 * MIB
    monkeypatch.setenv(env.SYMM_CAP_MIB, "inf")
    assert symm_cap.cap_bytes(torch.device("cuda", 1)) is None


def test_a_footprint_counts_the_signal_pad_in_whole_granules(monkeypatch):
    monkeypatch.setattr(symm_cap, "symm_mem_signal_pad", lambda: 9216)
    assert symm_cap.footprint(32 * MIB, shared_device=False) == 34 * MIB
    assert symm_cap.footprint(symm.FLAG_SLOTS * 4, shared_device=False) == 2 * MIB
    assert symm_cap.footprint(32 * MIB, shared_device=True) == 32 * MIB  # a caching-allocator tensor


def test_the_ledger_refuses_past_the_cap_with_the_figures(monkeypatch):
    monkeypatch.setenv(env.SYMM_CAP_MIB, "64")
    symm_cap.reset()
    try:
        symm_cap.hold("cpu", 40 * MIB)
        symm_cap.check("cpu", 24 * MIB, "shared buffer of 16 MiB", "rank 0 of group g")  # exactly at the cap
        with pytest.raises(symm_cap.SymmCapExceeded, match=r"40 MiB held \+ 26 MiB asked > cap 64 MiB"):
            symm_cap.check("cpu", 26 * MIB, "shared buffer of 16 MiB", "rank 0 of group g")
        symm_cap.release("cpu", 40 * MIB)
        assert symm_cap.held("cpu") == 0
    finally:
        symm_cap.reset()


@pytest.mark.parametrize("world", [2, 3])
def test_a_cap_reached_on_one_rank_runs_nccl_on_every_rank(world):
    for rank, (ran, events, held, refused, cap_lines, ops_lines) in enumerate(run_distributed(cap_on_one_rank, world)):
        last = rank == world - 1
        # 20 MiB: refused everywhere (the last rank's cap); 10 MiB: a GPU schedule everywhere;
        # 20 MiB again: refused at once, without a vote
        assert ran == ["sequential", "gpu 16 MiB", "sequential"], (rank, ran)
        assert refused == 32 and held == (80 + 18 if last else 18), (rank, held)
        # the last rank never allocated the 32 MiB buffer; the others did, and let it go
        allocated = ["allocate 16"] if last else ["allocate 32", "allocate 16"]
        assert events == allocated + ["rendezvous 16 holding []"], (rank, events)
        if last:
            assert len(cap_lines) == 1 and "cap of 100 MiB" in cap_lines[0], cap_lines
            assert "80 MiB held, 34 MiB asked" in cap_lines[0], cap_lines
        else:
            assert cap_lines == [], cap_lines
        assert len(ops_lines) == 2 and all("running sequential" in line for line in ops_lines), ops_lines
        assert "not allocated on every rank" in ops_lines[0] and "already failed" in ops_lines[1], ops_lines


@pytest.mark.parametrize("pin", [False, True], ids=["released", "pinned by a capture"])
def test_a_superseded_buffer_is_released_on_every_rank_at_the_same_call(pin):
    for rank, (events, same, after, first_freed, held, released) in enumerate(run_distributed(supersede, 2, pin)):
        assert same, rank  # 12 MiB fits the 16 MiB buffer: no new allocation
        # the old buffer is still held at the new one's rendezvous (every rank settled it by then),
        # and let go right after it
        assert events == ["allocate 16", "rendezvous 16 holding []", "allocate 32", "rendezvous 32 holding [16]",
                          "allocate 64", "rendezvous 64 holding [32]"], (rank, events)
        assert first_freed, rank  # its memory too (nothing else held it)
        if pin:  # the buffer a capture used stays: the graph replays its addresses
            assert after == [[32], [32, 64]] and held == 34 + 66, (rank, after, held)
            assert len(released) == 1 and "16 MiB" in released[0], released
        else:
            assert after == [[32], [64]] and held == 66, (rank, after, held)
            assert len(released) == 2 and "16 MiB" in released[0] and "32 MiB" in released[1], released


def test_the_views_cache_is_a_bounded_lru(monkeypatch):
    monkeypatch.setattr(symm_alloc, "MAX_VIEWS", 8)  # what SymmBuffer.view reads
    memory = [torch.arange(256, dtype=torch.uint8), torch.arange(256, dtype=torch.uint8).flip(0)]
    buf = symm.SymmBuffer(memory[0], _Handle(memory), 0, None)
    for n in range(1, 13):  # views of 1..12 bytes of the peer's copy: the first four are dropped
        buf.view(1, 0, (n,), torch.uint8)
    assert len(buf.views) == 8 and [key[2] for key in buf.views] == [(n,) for n in range(5, 13)]
    kept = buf.view(1, 0, (5,), torch.uint8)  # used again: the most recent now
    buf.view(1, 0, (13,), torch.uint8)
    assert [key[2] for key in buf.views][-2:] == [(5,), (13,)] and (6,) not in [key[2] for key in buf.views]
    assert buf.view(1, 0, (5,), torch.uint8) is kept
    rebuilt = buf.view(1, 16, (2,), torch.uint8)  # any view, dropped or not, aliases the same bytes
    assert rebuilt.data_ptr() == memory[1].data_ptr() + 16 and rebuilt.tolist() == [239, 238]


def test_a_runtime_whose_flag_array_was_refused_is_refused_at_once_afterwards(monkeypatch):
    made = []

    def refused(group_name, device):
        made.append(group_name)
        raise symm.SymmAllocError("commopt: the symmetric flag array for group g was not allocated on every rank")

    monkeypatch.setattr(symm, "GroupRuntime", refused)
    monkeypatch.setattr(symm, "_RUNTIMES", {})
    monkeypatch.setattr(symm, "_REFUSED", {})
    for _ in range(3):
        with pytest.raises(symm.SymmAllocError, match="flag array"):
            symm.runtime("g", torch.device("cuda", 0))
    assert made == ["g"]  # one vote, not one a call
