"""The host shortcuts name the same memory as the views they replace: a rank's receive slot for
a source (a cached symmetric view) is recv[src] in the reductions and slots[src] in the
all-gather, and a whole-segment piece is the tensor itself (layout.piece_rows), at two
and four ranks and for both buffer halves."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.gpu.layout import piece_rows
from torch_commopt.kernels.matmul.product import Product


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype) == (y.data_ptr(), y.shape, y.stride(), y.dtype)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("chunks", [1, 2])
def test_receive_slots_and_whole_pieces_are_the_views_they_replace(world, chunks):
    runtimes = fake_runtimes(world)
    a, w = torch.randn(8 * world, 16), torch.randn(16, 8)
    with faked_cuda(runtimes, None) as active:
        active(world - 1)
        for _ in range(2):  # consecutive calls take the two buffer halves
            call = mr._Call(Product(a, w), 0, "fake", Schedule("ce_push", chunks), "sum", phases=1)
            for src in range(world):
                assert _same(call.slot(call.rank, src), call.recv[src])
            if chunks == 1:  # the whole segment: _sum_slots then reads recv itself
                assert call.pieces == ((0, call.m_seg),) and call.n_chunks == 1
            seg = call.recv[0]
            assert piece_rows(seg, 0, call.m_seg) is seg
            for lo, hi in call.pieces:
                assert _same(piece_rows(seg, lo, hi), seg[lo:hi])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_gather_source_slots_are_the_slot_views(world, dtype):
    rt = fake_runtimes(world)[world - 1]
    m_loc, k = 6, 16
    row_bytes = k * torch.empty((), dtype=dtype).element_size()
    buf = rt.buffer(2 * world * m_loc * row_bytes)
    for half in (0, 1):
        base = half * (buf.nbytes // 2)
        slots = buf.view(rt.rank, base, (world, m_loc, k), dtype)
        for src in range(world):
            assert _same(agm._source_slot(buf, rt.rank, base, m_loc, k, row_bytes, dtype, src), slots[src])
