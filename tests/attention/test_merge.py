"""merge.py: partials over disjoint key sets merge into attention over their union."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torch_commopt.kernels.attention.local import attend_fwd
from torch_commopt.kernels.attention.merge import Accumulator, empty_accumulator, merge, merge_
from torch_commopt.testing.validate import rel_err, within_tolerance


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
    o, lse = attend_fwd(q, k, v, scale=0.25, backend="math")
    acc_o, acc_l = empty_accumulator(q, v.shape[-1], torch.float64)
    merge_(acc_o, acc_l, o, lse)
    assert torch.equal(acc_o, o) and torch.equal(acc_l, lse)
    skip_o, skip_l = attend_fwd(q, k, v, scale=0.25, mask="skip")
    merge_(acc_o, acc_l, skip_o, skip_l)
    assert torch.equal(acc_o, o) and torch.equal(acc_l, lse)
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


def test_rows_empty_on_both_sides_keep_the_accumulator_whatever_the_partial_holds():
    """A kernel may leave anything in a fully masked row of its output: with lse -inf on both
    sides the accumulator's row stays as it was."""
    out, lse = torch.zeros(1, 1, 3, 4), torch.tensor([[[float("-inf"), 0.5, float("-inf")]]])
    out_b, lse_b = torch.full((1, 1, 3, 4), 7.0), torch.tensor([[[float("-inf"), float("-inf"), 1.0]]])
    merge_(out, lse, out_b, lse_b)
    assert (out[0, 0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0])
    assert (out[0, 0, 1] == 0).all() and lse[0, 0, 1] == 0.5  # the partial is empty: weight 0
    assert (out[0, 0, 2] == 7).all() and lse[0, 0, 2] == 1.0  # the accumulator is empty: the partial


def test_accumulator_takes_the_first_whole_partial_and_merges_the_rest():
    q, k, v = _qkv(11)
    full_out, full_lse = attend_fwd(q, k, v, scale=0.25, backend="math")
    (oa, la), (ob, lb) = _halves(q, k, v, 4)
    acc = Accumulator(q, v.shape[-1], torch.float64)
    acc.add(slice(None), oa, la)
    assert acc.out is not oa and acc.out.is_contiguous()  # a copy: the partial is not written
    acc.add(slice(None), ob, lb)
    out, lse = acc.result()
    assert rel_err(out, full_out) < 1e-12 and rel_err(lse, full_lse) < 1e-12
    part = Accumulator(q, v.shape[-1], torch.float64)  # a first partial over some rows: from empty
    part.add(slice(2, 6), oa[:, :, 2:], la[:, :, 2:])
    out, lse = part.result()
    assert (out[:, :, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    assert rel_err(out[:, :, 2:], oa[:, :, 2:]) < 1e-15
    empty_out, empty_lse = Accumulator(q, v.shape[-1], torch.float64).result()
    assert (empty_out == 0).all() and torch.isneginf(empty_lse).all()


def test_a_half_first_partial_is_merged_in_place_once_and_converted_before_more_merges():
    """A bf16 first partial stays bf16 for a last merge (math in fp32, rounded once: the same
    as merging in an fp32 accumulator and rounding the result); a merge with more to come
    converts it to the acc dtype first."""
    q, k, v = _qkv(13, s_k=12)
    thirds = [attend_fwd(q.float(), k[:, :, c].float(), v[:, :, c].float(), scale=0.25, backend="math")
              for c in (slice(0, 4), slice(4, 8), slice(8, 12))]
    parts = [(o.bfloat16(), lse) for o, lse in thirds]
    rows = slice(2, 6)

    ref = Accumulator(q, v.shape[-1], torch.float32)
    ref.add(slice(None), parts[0][0].float(), parts[0][1])
    ref.add(rows, parts[1][0][:, :, rows], parts[1][1][:, :, rows])
    one = Accumulator(q, v.shape[-1], torch.float32)
    first = parts[0][0].clone()
    one.add(slice(None), first, parts[0][1])
    assert one.out is first  # handed over, not copied
    one.add(rows, parts[1][0][:, :, rows], parts[1][1][:, :, rows], last=True)
    out, lse = one.result()
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.result()[0].bfloat16())
    assert torch.equal(lse, ref.result()[1])

    three = Accumulator(q, v.shape[-1], torch.float32)
    three.add(slice(None), parts[0][0].clone(), parts[0][1])
    three.add(slice(None), *parts[1])
    assert three.out.dtype == torch.float32  # another merge follows: accumulate in fp32
    three.add(slice(None), *parts[2], last=True)
    truth, _ = attend_fwd(q, k, v, scale=0.25, backend="math")
    bf16_rounding = rel_err(truth.bfloat16(), truth)
    assert within_tolerance(rel_err(three.result()[0], truth), 4 * bf16_rounding)


TRITON_CHECK = """
import torch
from torch_commopt.kernels.attention import merge_triton
from torch_commopt.kernels.attention.merge import _merge_torch
g = torch.Generator().manual_seed(5)
worst = 0.0
for d in (64, 96, 128):
    full_out, full_lse = torch.randn(2, 4, 300, d, generator=g), torch.randn(2, 4, 300, generator=g) * 3
    out, lse = full_out[:, :, 100:250], full_lse[:, :, 100:250]
    out_b = torch.randn(2, 4, 150, d, generator=g).to(torch.bfloat16)
    lse_b = torch.randn(2, 4, 150, generator=g) * 3
    lse[:, :, :10] = float("-inf"); out[:, :, :10] = 0; lse_b[:, :, 5:15] = float("-inf")
    ref_out, ref_lse = out.double().clone(), lse.double().clone()
    _merge_torch(ref_out, ref_lse, out_b.double(), lse_b.double())
    before = full_out.clone()
    merge_triton.merge_(out, lse, out_b, lse_b)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = ~torch.isneginf(ref_lse)
    worst = max(worst, float((lse[finite].double() - ref_lse[finite]).abs().max()),
                float((out.double() - ref_out).norm() / ref_out.norm()))
    assert torch.equal(full_out[:, :, :100], before[:, :, :100]) and torch.equal(full_out[:, :, 250:], before[:, :, 250:])
assert worst < 1e-5, worst
# a half-precision accumulator (a last merge): fp32 math, rounded once, as the torch path does
out16, lse16 = full_out[:, :, 100:250].bfloat16(), full_lse[:, :, 100:250].clone()
ref16, ref_lse16 = out16.clone(), lse16.clone()
_merge_torch(ref16, ref_lse16, out_b, lse_b)
merge_triton.merge_(out16, lse16, out_b, lse_b)
assert out16.dtype == torch.bfloat16
assert float((out16.double() - ref16.double()).norm() / ref16.double().norm()) < 1e-2
assert (out16.double() - ref16.double()).abs().max() <= 2 ** -7 * ref16.double().abs().max()
print("ok", worst)
"""


def test_triton_merge_kernel_in_the_interpreter_matches_the_torch_merge(triton_interpreter):
    """The CUDA merge kernel (merge_triton.py) run by Triton's CPU interpreter (Triton is in
    the test extras; tests/gpu runs the kernel on the GPU)."""
    res = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=triton_interpreter, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]


def test_local_gradient_sum_keeps_a_half_term_and_rounds_once():
    """ring_bwd's dq sum: the first whole bf16 term is handed over; a last term is added in
    place in bf16 (fp32 math, one rounding: equal to summing in fp32 and rounding at the end);
    a term with more to come converts the sum to fp32 first."""
    from torch_commopt.kernels.attention.ring import LocalSum

    gen = torch.Generator().manual_seed(21)
    like = torch.empty(2, 3, 8, 16, dtype=torch.bfloat16)
    terms = [torch.randn(2, 3, 8, 16, generator=gen).bfloat16() for _ in range(3)]
    rows = slice(3, 7)
    two = LocalSum(like, torch.float32)
    first = terms[0].clone()
    two.add(slice(None), first, last=False)
    assert two.sum is first
    two.add(rows, terms[1][:, :, rows], last=True)
    want = terms[0].float()
    want[:, :, rows] += terms[1][:, :, rows].float()
    assert two.sum.dtype == torch.bfloat16 and torch.equal(two.result(torch.bfloat16), want.bfloat16())
    three = LocalSum(like, torch.float32)
    three.add(slice(None), terms[0].clone(), last=False)
    three.add(slice(None), terms[1], last=False)
    assert three.sum.dtype == torch.float32
    three.add(slice(None), terms[2], last=True)
    exact = sum(t.double() for t in terms)
    assert torch.equal(three.result(torch.bfloat16), exact.float().bfloat16())
    assert (LocalSum(like, torch.float32).result(torch.bfloat16) == 0).all()
