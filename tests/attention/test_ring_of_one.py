"""A ring of one rank (Ulysses' local attention, a hybrid of ring degree 1) moves nothing."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.kernels.attention import comm
from torch_commopt.kernels.attention.ring import contiguous_plan, ring_bwd, ring_fwd


def test_a_ring_of_one_rank_hands_back_its_tensors_uncopied():
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    shift = comm.ring_shift([k, v], None, 0)
    assert isinstance(shift, comm.Unmoved)
    k1, v1 = shift.current()
    assert k1.data_ptr() == k.data_ptr() and v1.data_ptr() == v.data_ptr()  # no packing copy
    with pytest.raises(RuntimeError, match="nothing to shift"):
        shift.start()
    shift.finish()
    strided = torch.randn(1, 8, 2, 4).transpose(1, 2)  # a non-contiguous input is laid out once
    (got,) = comm.ring_shift([strided], None, 0).current()
    assert got.is_contiguous() and torch.equal(got, strided)


@pytest.mark.parametrize("causal", [False, True])
def test_a_ring_of_one_rank_is_full_attention_forward_and_backward(causal):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64)
    scale = 8 ** -0.5
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    want.backward(dout)
    plan = contiguous_plan(causal)
    with torch.no_grad():
        out, lse = ring_fwd(q, k, v, scale=scale, plan=plan, group=None, backend="math")
        grads = ring_bwd(dout, (q, k, v, out, lse), scale=scale, plan=plan, group=None, backend="math")
    assert torch.allclose(out, want, atol=1e-10)
    for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got, ref, atol=1e-10)
