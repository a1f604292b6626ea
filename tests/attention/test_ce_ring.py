"""The copy-engine ring's switch (attention/ce_ring.py): off unless asked for, never on CPU
tensors or a rank alone, and an unknown transport name is logged and read as nccl (the GPU
protocol itself is tested in tests/gpu/test_cp_attention_gpu.py)."""

from __future__ import annotations

import logging

import torch

from torch_commopt.attention import ce_ring, comm


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_transport_defaults_to_nccl_and_reads_ce(monkeypatch):
    monkeypatch.delenv(ce_ring.ENV, raising=False)
    assert ce_ring.transport() == "nccl"
    monkeypatch.setenv(ce_ring.ENV, " CE ")
    assert ce_ring.transport() == "ce"


def test_an_unknown_transport_is_logged_and_read_as_nccl(monkeypatch, caplog):
    monkeypatch.setenv(ce_ring.ENV, "nvshmem")
    with caplog.at_level(logging.WARNING, logger=ce_ring.log.name):
        assert ce_ring.transport() == "nccl"
    assert any("nvshmem" in r.getMessage() for r in caplog.records)


def test_cpu_tensors_and_lone_ranks_keep_the_nccl_shift(monkeypatch):
    monkeypatch.setenv(ce_ring.ENV, "ce")
    t = torch.zeros(4)
    assert not ce_ring.usable([t], _Group(2))
    assert not ce_ring.usable([t], None)
    assert isinstance(comm.ring_shift([t], None, 0), comm.RingShift)


def test_slot_bytes_align_every_piece():
    a, b = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.float32)
    assert ce_ring.slot_bytes([a, b]) == 256 + 512
