"""A (B, S, K) activation gathered or scattered along S (sequence parallelism at batch > 1): a
rank's rows are one block in every batch element, strided in the full tensor.  The GPU
schedules multiply such row blocks with one batched GEMM that reads and writes them in place
(no copy into a matrix and back: at batch 4 those copies cost a TP=2 training step ~5 ms on 2x
H200) and move them with one 2-D copy-engine copy.  Checked here on the CPU: the
products against plain matmuls, that the segments are views of A, and that a strided copy is
queued as one 2-D copy of the right rows."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import fake_runtimes, faked_cuda

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu.symm import pitched
from torch_commopt.kernels.matmul.gpu import ag_matmul as agm
from torch_commopt.kernels.matmul.gpu import matmul_reduce as mr
from torch_commopt.kernels.matmul.gpu.layout import RowLayout, as_blocks
from torch_commopt.kernels.matmul.product import Product
from torch_commopt.kernels.scaled import add_matmul_, matmul

B, LIN, K, N = 4, 3, 16, 8


def _shares_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() and lo <= view.data_ptr() < hi


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_a_batched_product_writes_a_ranks_strided_output_rows_in_place(world, bias):
    g = torch.Generator().manual_seed(world)
    lay = RowLayout(B, LIN, world)
    rows = torch.randn(B * LIN, K, generator=g)
    w = torch.randn(N, K, generator=g).t()  # a transposed weight, as nn.Linear's
    b = torch.randn(N, generator=g) if bias else None
    full = torch.full((B * world * LIN, N), float("nan"))
    dst = lay.block_rows(full, 1, 0, B * LIN)
    assert dst.dim() == 3 and not dst.is_contiguous()
    out = matmul(as_blocks(rows, dst), w, b, out=dst)
    assert out.data_ptr() == dst.data_ptr()
    want = rows @ w + (b if bias else 0)
    got = full.view(B, world, LIN, N)
    torch.testing.assert_close(got[:, 1].reshape(-1, N), want)
    assert torch.isnan(got[:, 0]).all()  # the other ranks' rows untouched


def test_a_batched_add_scales_the_output_and_the_product():
    g = torch.Generator().manual_seed(5)
    rows, w = torch.randn(B, LIN, K, generator=g), torch.randn(K, N, generator=g)
    out = torch.randn(B, LIN, N, generator=g)
    want = 0.5 * out + 0.25 * (rows @ w)
    add_matmul_(out, rows, w, beta=0.5, alpha=0.25)
    torch.testing.assert_close(out, want)


def test_scaled_products_of_row_blocks_are_refused():
    from torch_commopt.kernels.scaled import Scaled

    sc = Scaled(torch.ones(()), (torch.ones(()),), torch.bfloat16, False)
    with pytest.raises(ValueError, match="2-D only"):
        matmul(torch.randn(2, 3, 4), torch.randn(4, 5), None, sc)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_segments_are_views_of_a_and_their_pieces_multiply_right(world, chunks):
    g = torch.Generator().manual_seed(world * 10 + chunks)
    a, w = torch.randn(B, world * LIN, K, generator=g), torch.randn(K, N, generator=g)
    more = (torch.randn(B, world * LIN, 4, generator=g), torch.randn(4, N, generator=g))
    with faked_cuda(fake_runtimes(world), None) as active:
        active(world - 1)
        call = mr._Call(Product(a, w, parts=(more,)), 1, "fake", Schedule("ce_push", chunks), "sum", phases=1)
        assert call.lay.outer == B and len(call.pieces) == min(chunks, B)
        for p in range(world):
            seg = call.segment_a(p)
            assert [x.shape for x in seg] == [(B, LIN, K), (B, LIN, 4)]
            assert _shares_storage(seg[0], a) and _shares_storage(seg[1], more[0])  # no copy
            want = a[:, p * LIN:(p + 1) * LIN] @ w + more[0][:, p * LIN:(p + 1) * LIN] @ more[1]
            out = torch.full((call.m_seg, N), float("nan"))
            for lo, hi in call.pieces:
                call.product(call.piece(seg, lo, hi), out[lo:hi])
            torch.testing.assert_close(out.view(B, LIN, N), want)
            call.add_product(out, seg)  # alpha 1: the product once more
            torch.testing.assert_close(out.view(B, LIN, N), 2 * want)


def test_float8_segments_stay_matrices():
    """_scaled_mm multiplies 2-D operands only: a scaled call's segments are still copied."""
    from torch_commopt.kernels.scaled import Scaled

    a, w = torch.randn(B, 2 * LIN, K), torch.randn(K, N)
    sc = Scaled(torch.ones(()), (torch.ones(()),), torch.bfloat16, False)
    with faked_cuda(fake_runtimes(2), None) as active:
        active(0)
        call = mr._Call(Product(a, w, sc=sc), 1, "fake", Schedule("ce_push", 1), "sum", phases=1)
        assert call.segment_a(1)[0].shape == (B * LIN, K)


def test_pitched_names_equal_runs_at_a_uniform_pitch_and_nothing_else():
    full = torch.zeros(B, 2, LIN, N)
    block = full[:, 1]  # (B, LIN, N): B runs of LIN * N elements, 2 * LIN * N apart
    elt = full.element_size()
    assert pitched(block) == (block.data_ptr(), 2 * LIN * N * elt, LIN * N * elt)
    assert pitched(torch.zeros(5, 6))[1:] == (6 * elt, 6 * elt)  # contiguous: one pitch, rows back to back
    assert pitched(torch.zeros(5, 6).t()) is None  # columns
    assert pitched(full[:, :, 1]) is None  # (B, 2, N): its rows are not one run per outer block
    assert pitched(torch.zeros(4)) is None


@pytest.mark.parametrize("world", [2, 3])
def test_the_gathered_input_is_assembled_by_2d_copies(world):
    """ag_matmul with return_gathered on a (B, LIN, K) shard gathered along dim 1: each rank's
    block of the gathered output is one 2-D copy (B rows of LIN * K elements at the gathered
    pitch), queued on the side stream -- no SM copy."""
    a = torch.randn(B, LIN, K)
    ws = [torch.randn(K, N)]
    runtimes, queue = fake_runtimes(world), []
    with faked_cuda(runtimes, queue) as active:
        active(0)
        outs = agm.ag_matmul_gpu(a, ws, [None], 1, "fake", Schedule("ce_push", 1), True)
    gathered = outs[-1]
    assert gathered.shape == (B, world * LIN, K)
    elt = a.element_size()
    copies_2d = [op for _, _, op in queue if op[0] == "copy" and len(op[3]) == B]
    for src in range(world):
        base = gathered.data_ptr() + src * LIN * K * elt
        want = tuple((base + b * world * LIN * K * elt, base + b * world * LIN * K * elt + LIN * K * elt)
                     for b in range(B))
        assert sum(op[3] == want for op in copies_2d) == 1, f"rank {src}'s block"
    # the own shard's product landed in the strided output rows (the peers' products read their
    # slots, whose copies the fake does not perform)
    torch.testing.assert_close(outs[0].view(B, world, LIN, N)[:, 0], a @ ws[0])


def test_a_pitch_beyond_the_copy_engines_limit_falls_back_to_a_tensor_copy(monkeypatch):
    from torch_commopt.kernels.gpu import symm

    monkeypatch.setattr(symm, "MAX_PITCH", 8)  # below this test's pitch: as a pitch over 2 GiB would be
    a = torch.randn(B, LIN, K)
    runtimes, queue = fake_runtimes(2), []
    with faked_cuda(runtimes, queue) as active:
        active(0)
        outs = agm.ag_matmul_gpu(a, [torch.randn(K, N)], [None], 1, "fake", Schedule("ce_push", 1), True)
    assert not [op for _, _, op in queue if op[0] == "copy" and len(op[3]) == B]  # no 2-D copy queued
    torch.testing.assert_close(outs[-1][:, :LIN], a)  # the own block, copied by Tensor.copy_ (done at once here)


class _Dispatches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen operations a call dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sched", ["ce_push:1:par=1", "ce_push:2"])
def test_an_all_gather_of_row_blocks_dispatches_one_view_per_product(sched):
    """Host cost (each dispatch is ~1-2 us of a region call's host time on the GPU machine):
    each weight is expanded to the row blocks' batch once a call, each product's strided
    destination is one view (no view + slice + select), and the gathered input is copied by
    address (no view of it) -- while every product still lands where it belongs."""
    world, ws = 2, [torch.randn(K, N) for _ in range(3)]
    a = torch.randn(B, LIN, K)
    runtimes = fake_runtimes(world)
    call = lambda: agm.ag_matmul_gpu(a, ws, [None] * 3, 1, "fake", Schedule.parse(sched), True)  # noqa: E731
    with faked_cuda(runtimes, None) as active:
        active(0)
        call(), call()  # the buffer's views of both halves are made once, at their first use
        with _Dispatches() as seen:
            outs = call()
    pieces = int(sched.split(":")[1])
    assert seen.ops.get("expand") == len(ws) * (1 if pieces == 1 else 2)  # per call, or per piece size
    assert "select" not in seen.ops and seen.ops.get("slice", 0) == (0 if pieces == 1 else pieces)  # the slot's pieces
    products = len(ws) * (1 + (world - 1) * pieces)  # the own shard whole, the peer's by pieces
    assert seen.ops["bmm"] == products and seen.ops["as_strided"] == products  # one destination view each
    for out, w in zip(outs, ws):
        torch.testing.assert_close(out.view(B, world, LIN, N)[:, 0], a @ w)


def test_a_pulled_reduce_scatter_of_row_blocks_expands_its_weight_once_per_piece_size():
    """ce_pull:2 at batch 4: the weight is expanded once for both pieces and both segments, and the
    slots' pieces are the buffer's cached views (no slice of a slot a call)."""
    a, w = torch.randn(B, 2 * LIN, K), torch.randn(K, N)
    runtimes = fake_runtimes(2)
    call = lambda: mr.matmul_rs_gpu(Product(a, w), 1, "sum", "fake", Schedule.parse("ce_pull:2"))  # noqa: E731
    with faked_cuda(runtimes, None) as active:
        active(0)
        call(), call()  # the buffer's views of both halves are made once, at their first use
        with _Dispatches() as seen:
            call()
    assert seen.ops.get("expand") == 1
    assert seen.ops["bmm"] + seen.ops["baddbmm_"] == 4  # two segments x two pieces
    # per piece: the peer's and the own segment's A blocks, and the output's rows; no slot slices
    assert seen.ops.get("slice", 0) == 6 and "select" not in seen.ops
