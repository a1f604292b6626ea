"""The copy-engine all-to-alls (kernels/attention/ce_a2a.py): never on CPU tensors or a rank alone, the
ranks' vote on taking part, and the byte layout of a slot (its environment switch:
test_switches.py; the GPU protocol itself is tested in tests/gpu/test_cp_attention_gpu.py)."""

from __future__ import annotations

import cp_programs
import torch

from torch_commopt.kernels.attention import ce_a2a
from torch_commopt.testing.launch import run_distributed


def test_cpu_tensors_and_lone_ranks_keep_nccl(monkeypatch):
    monkeypatch.setenv(ce_a2a.ENV, "ce")
    x = torch.randn(1, 4, 8, 16)
    assert not ce_a2a.usable([x, x, x], None, 1, [(x.shape, x.dtype)])


def test_every_rank_gets_the_same_vote():
    """One host with peer access: yes everywhere; a rank elsewhere or without peer access: no
    everywhere, with the reason (a rank going on alone would wait for flags forever)."""
    for world in (2, 3):
        for votes in run_distributed(cp_programs.run_a2a_votes, world, timeout_s=60):
            assert votes == [(True, ""), (False, "spans hosts"), (False, "has GPUs without peer access")]


def test_slot_layout_keeps_every_piece_aligned_and_sized_for_its_group():
    q = torch.empty(2, 8, 5, 16, dtype=torch.bfloat16)  # B 2, H 8, S_loc 5, D 16
    k = torch.empty(2, 4, 5, 16, dtype=torch.bfloat16)
    lse = (torch.Size([2, 8, 5]), torch.float32)
    lay = ce_a2a._Layout([q, k, k], [((2, 8, 5, 16), torch.bfloat16), lse], groups=2, n=2)
    # IN: this rank's [B, H/(G n), n S_loc, D] of each input; OUT: per source, [B, H/(G n), S_loc, D]
    assert lay.ins == [0, 1280, 1280 + 768]  # 2*2*10*16*2 = 1280; 2*1*10*16*2 = 640 -> 768
    assert lay.in_bytes == 1280 + 768 + 768
    assert lay.outs == [0, 768] and lay.out_bytes == 768 + 256  # 2*2*5*16*2 = 640 -> 768; 2*2*5*4 = 80 -> 256
    assert lay.half == lay.in_bytes + 2 * lay.out_bytes and lay.half % 256 == 0


def test_rows_that_are_not_runs_are_copied_once():
    x = torch.randn(2, 4, 6, 8)
    assert ce_a2a._rows_ok(x) is x
    assert ce_a2a._rows_ok(x[:, 1:3]) is not None and ce_a2a._rows_ok(x[:, 1:3]).data_ptr() == x[:, 1:3].data_ptr()
    bshd = torch.randn(2, 6, 4, 8).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D) memory
    fixed = ce_a2a._rows_ok(bshd)
    assert fixed.is_contiguous() and torch.equal(fixed, bshd)
    lse = torch.randn(2, 4, 6)
    assert ce_a2a._rows_ok(lse) is lse


class _HostDriver:
    """driver.memcpy2d_async on host memory (the pitch checks the CUDA driver makes)."""

    @staticmethod
    def memcpy2d_async(stream, dst, dst_pitch, src, src_pitch, width, height):
        import ctypes

        assert src_pitch >= width and dst_pitch >= width, (src_pitch, dst_pitch, width)
        for r in range(height):
            ctypes.memmove(dst + r * dst_pitch, src + r * src_pitch, width)


class _Copier:
    driver = _HostDriver()
    copy_rows = ce_a2a._Pipeline._copy_rows


def test_row_copies_land_where_the_layout_says():
    """_copy_rows's address arithmetic, run on host memory: heads [1, 3), tokens [2, 5) of a
    (B 2, H 4, S 6, D 8) tensor into a [B, 2, 3, D] block; and one head whose size-1 dim has
    an odd stride (the driver's pitch check would refuse it as the pitch)."""
    x = torch.randn(2, 4, 6, 8)
    dst = torch.zeros(2, 2, 3, 8)
    row = 3 * 8 * 4
    _Copier().copy_rows(None, dst.data_ptr(), row, 2 * row, ce_a2a._Geo(x), range(1, 3), range(2, 5))
    assert torch.equal(dst, x[:, 1:3, 2:5])
    one = torch.randn(2, 6, 8).unsqueeze(1).as_strided((2, 1, 6, 8), (48, 1, 8, 1))
    dst = torch.zeros(2, 1, 6, 8)
    _Copier().copy_rows(None, dst.data_ptr(), 6 * 8 * 4, 6 * 8 * 4, ce_a2a._Geo(one), range(1), range(6))
    assert torch.equal(dst, one)


def test_rows_ok_copies_exactly_where_a_row_is_not_contiguous():
    """_rows_ok reads the strides arithmetically (the host path calls it per tensor and pass):
    it keeps x exactly where x[0, 0] is contiguous, its seq stride is the tail's size and its
    last stride 1 (what the copy geometry needs), and copies otherwise."""
    def reference(x):
        t = 1
        for n in x.shape[3:]:
            t *= n
        return x.dim() >= 3 and (x.dim() == 3 or x[0, 0].is_contiguous()) and x.stride(2) == t and \
            (x.dim() == 3 or x.stride(-1) == 1)

    base = torch.randn(2, 4, 6, 8)
    cases = [base, base.transpose(1, 2), base[:, 1:3], base[:, :, 1:5], base[..., :4], base.transpose(2, 3),
             base[:, :1], base[:, :, :1], base.unsqueeze(-1), base.reshape(2, 4, 48), base.reshape(2, 4, 48)[:, :, ::2],
             torch.randn(2, 6, 8).unsqueeze(1).as_strided((2, 1, 6, 8), (48, 1, 8, 1)), torch.randn(3, 5),
             torch.randn(2, 3, 1, 8).as_strided((2, 3, 1, 8), (24, 8, 5, 1)), base.permute(0, 1, 3, 2).contiguous()]
    for x in cases:
        got = ce_a2a._rows_ok(x)
        assert (got is x) == (reference(x) or x.is_contiguous()), (tuple(x.shape), x.stride())  # contiguous(): x
        assert torch.equal(got, x)
