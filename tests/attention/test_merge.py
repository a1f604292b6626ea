"""merge.py: partials over disjoint key sets merge into attention over their union."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.attention.local import attend_fwd
from torch_commopt.attention.merge import empty_accumulator, merge, merge_
from torch_commopt.validate import rel_err, within_tolerance


def _qkv(seed, s_q=6, s_k=10, h=4, h_kv=2, d=16, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, h, s_q, d, generator=gen, dtype=dtype), torch.randn(2, h_kv, s_k, d, generator=gen, dtype=dtype),
            torch.randn(2, h_kv, s_k, d, generator=gen, dtype=dtype))


def _halves(q, k, v, cut):
    a = attend_fwd(q, k[:, :, :cut], v[:, :, :cut], scale=0.25, backend="math")
    b = attend_fwd(q, k[:, :, cut:], v[:, :, cut:], scale=0.25, backend="math")
    return a, b


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_two_halves_of_the_keys_merge_into_full_attention(cut):
    q, k, v = _qkv(cut)
    full_out, full_lse = attend_fwd(q, k, v, scale=0.25, backend="math")
    (oa, la), (ob, lb) = _halves(q, k, v, cut)
    out, lse = merge(oa, la, ob, lb)
    assert rel_err(out, full_out) < 1e-13 and rel_err(lse, full_lse) < 1e-13
    out2, lse2 = merge(ob, lb, oa, la)  # either order
    assert rel_err(out2, full_out) < 1e-13 and rel_err(lse2, full_lse) < 1e-13


def test_merge_in_fp32_is_as_close_as_eager_fp32():
    q, k, v = _qkv(7)
    truth, _ = attend_fwd(q, k, v, scale=0.25, backend="math")
    eager = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.25,
                                                             enable_gqa=True)
    (oa, la), (ob, lb) = _halves(q.float(), k.float(), v.float(), 4)
    out, lse = merge(oa, la, ob, lb)
    assert out.dtype == lse.dtype == torch.float32
    assert within_tolerance(rel_err(out, truth), rel_err(eager, truth))


def test_bf16_partial_merges_into_an_fp32_accumulator():
    q, k, v = _qkv(3)
    (oa, la), (ob, lb) = _halves(q.float(), k.float(), v.float(), 4)
    out, lse = merge(oa, la, ob.bfloat16(), lb)
    assert out.dtype == torch.float32
    assert rel_err(out, merge(oa, la, ob, lb)[0]) < 1e-2


def test_an_empty_side_gives_the_other_side_and_two_empty_sides_no_nan():
    q, k, v = _qkv(1)
    o, l = attend_fwd(q, k, v, scale=0.25, backend="math")
    acc_o, acc_l = empty_accumulator(q, v.shape[-1], torch.float64)
    merge_(acc_o, acc_l, o, l)
    assert torch.equal(acc_o, o) and torch.equal(acc_l, l)
    skip_o, skip_l = attend_fwd(q, k, v, scale=0.25, mask="skip")
    merge_(acc_o, acc_l, skip_o, skip_l)
    assert torch.equal(acc_o, o) and torch.equal(acc_l, l)
    e_o, e_l = empty_accumulator(q, v.shape[-1], torch.float64)
    merge_(e_o, e_l, skip_o, skip_l)
    assert not e_o.isnan().any() and (e_o == 0).all() and torch.isneginf(e_l).all()


def test_merge_writes_through_a_view_of_the_sequence_dim():
    """The ring merges a block of query rows into a slice of the accumulator."""
    q, k, v = _qkv(5)
    (oa, la), (ob, lb) = _halves(q, k, v, 4)
    out, lse = oa.clone(), la.clone()
    merge_(out[:, :, 2:], lse[:, :, 2:], ob[:, :, 2:], lb[:, :, 2:])
    want_o, want_l = merge(oa, la, ob, lb)
    assert torch.equal(out[:, :, :2], oa[:, :, :2]) and rel_err(out[:, :, 2:], want_o[:, :, 2:]) < 1e-13
    assert rel_err(lse[:, :, 2:], want_l[:, :, 2:]) < 1e-13
