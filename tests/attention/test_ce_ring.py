"""The copy-engine ring's switch (kernels/attention/ce_ring.py): never on CPU tensors or a rank alone
(its environment switch: test_switches.py; the GPU protocol itself is tested in
tests/gpu/test_cp_attention_gpu.py)."""

from __future__ import annotations

import torch

from torch_commopt.kernels.attention import ce_ring, comm


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_cpu_tensors_and_lone_ranks_take_no_copy_engine_shift(monkeypatch):
    monkeypatch.setenv(ce_ring.ENV, "ce")
    t = torch.zeros(4)
    assert not ce_ring.usable([t], _Group(2))
    assert not ce_ring.usable([t], None)
    assert isinstance(comm.ring_shift([t], None, 0), comm.Unmoved)  # a lone rank moves nothing


def test_slot_bytes_align_every_piece():
    a, b = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.float32)
    assert ce_ring.slot_bytes([a, b]) == 256 + 512
