"""local.py / fused.py on CPU: the block-attention registry, the math reference against eager
SDPA, block gradients given the global out/lse, cpu_flash against math, and the CUDA adapters'
argument plumbing on meta tensors (their numerics need a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_commopt.kernels.attention import local
from torch_commopt.kernels.attention.local import attend_bwd, attend_fwd, backends, pick
from torch_commopt.testing.validate import rel_err, within_tolerance


def _inputs(seed, h=4, h_kv=2, s_q=8, s_k=8, d=64, dv=None, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, h, s_q, d), (2, h_kv, s_k, d), (2, h_kv, s_k, dv or d), (2, h, s_q, dv or d)]
    return [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _eager(q, k, v, dout, causal, scale):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)


SQUARE = [((4, 2), 64, None, 8), ((4, 1), 128, None, 8), ((4, 4), 64, 32, 8)]


@pytest.mark.parametrize("causal,heads,d,dv,s_k", [(c,) + p for c in (False, True) for p in SQUARE]
                         + [(False, (6, 3), 64, None, 12)])  # a causal block is square; a full one need not be
def test_math_matches_eager_sdpa(causal, heads, d, dv, s_k):
    q, k, v, dout = _inputs(0, *heads, s_k=s_k, d=d, dv=dv)
    truth = _eager(q, k, v, dout, causal, 0.1)
    eager = _eager(*(t.float() for t in (q, k, v, dout)), causal, 0.1)
    mask = "causal" if causal else "full"
    qf, kf, vf, df = (t.float() for t in (q, k, v, dout))
    out, lse = attend_fwd(qf, kf, vf, scale=0.1, mask=mask, backend="math")
    grads = attend_bwd(df, (qf, kf, vf, out, lse), scale=0.1, mask=mask, backend="math")
    assert out.shape == truth[0].shape and lse.shape == out.shape[:3] and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]  # dK/dV keep H_kv heads
    for name, got, want, ref in zip(("out", "dq", "dk", "dv"), (out,) + grads, truth, eager):
        assert within_tolerance(rel_err(got, want), rel_err(ref, want)), name


def test_block_gradients_given_the_global_out_and_lse_sum_to_the_full_gradients():
    """What the ring relies on: per K/V block backward with the merged out/lse is exact."""
    q, k, v, dout = _inputs(1, s_q=8, s_k=8)
    out, lse = attend_fwd(q, k, v, scale=0.125, mask="causal", backend="math")
    full = attend_bwd(dout, (q, k, v, out, lse), scale=0.125, mask="causal", backend="math")
    # keys 0..3 against queries 4..7 are all in the past ("full"), keys 4..7 the diagonal
    lo = attend_bwd(dout[:, :, 4:], (q[:, :, 4:], k[:, :, :4], v[:, :, :4], out[:, :, 4:], lse[:, :, 4:]),
                    scale=0.125, mask="full", backend="math")
    diag = attend_bwd(dout[:, :, 4:], (q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], out[:, :, 4:], lse[:, :, 4:]),
                      scale=0.125, mask="causal", backend="math")
    top = attend_bwd(dout[:, :, :4], (q[:, :, :4], k[:, :, :4], v[:, :, :4], out[:, :, :4], lse[:, :, :4]),
                     scale=0.125, mask="causal", backend="math")
    assert rel_err(torch.cat([top[0], lo[0] + diag[0]], 2), full[0]) < 1e-13
    for i in (1, 2):
        assert rel_err(torch.cat([top[i] + lo[i], diag[i]], 2), full[i]) < 1e-13


def test_skip_block_sees_no_key():
    q, k, v, dout = _inputs(2)
    out, lse = attend_fwd(q, k, v, scale=0.1, mask="skip")
    assert (out == 0).all() and torch.isneginf(lse).all()
    assert all((g == 0).all() for g in attend_bwd(dout, (q, k, v, out, lse), scale=0.1, mask="skip"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_cpu_flash_matches_math(dtype, mask):
    q, k, v, dout = _inputs(3)
    truth = attend_fwd(q, k, v, scale=0.1, mask=mask, backend="math")
    truth_g = attend_bwd(dout, (q, k, v, *truth), scale=0.1, mask=mask, backend="math")
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    ref_out = attend_fwd(q, k, v, scale=0.1, mask=mask, backend="math")[0].to(dtype)  # eager-like rounding
    out, lse = attend_fwd(q, k, v, scale=0.1, mask=mask, backend="cpu_flash")
    grads = attend_bwd(dout, (q, k, v, out, lse), scale=0.1, mask=mask, backend="cpu_flash")
    assert lse.dtype == torch.float32 and grads[1].shape == k.shape and grads[1].dtype == torch.float32
    assert within_tolerance(rel_err(out, truth[0]), rel_err(ref_out, truth[0]))
    assert rel_err(lse, truth[1]) < 10 * torch.finfo(dtype).eps
    for got, want in zip(grads, truth_g):
        assert rel_err(got, want) < 20 * torch.finfo(dtype).eps


def test_registry_picks_math_on_cpu_and_names_what_it_refuses():
    q, k, v, _ = _inputs(4)
    assert pick(q, k).name == "math" and pick(q, k, "cpu_flash").name == "cpu_flash"
    assert {"math", "cpu_flash", "flash", "cudnn", "efficient", "flash_attn"} <= set(backends())
    assert not backends()["cpu_flash"].auto
    with pytest.raises(ValueError, match="unknown 'nope'"):
        pick(q, k, "nope")
    with pytest.raises(ValueError, match="'flash' cannot take this call: not a CUDA tensor"):
        pick(q, k, "flash")
    with pytest.raises(ValueError, match="not floating"):
        pick(q.long(), k.long(), "math")


@pytest.mark.parametrize("bad", [dict(mask="diag"), dict(s_k=6, mask="causal"), dict(h_kv=3)])
def test_bad_blocks_are_refused(bad):
    mask = bad.pop("mask", "full")
    q, k, v, _ = _inputs(5, **bad)
    with pytest.raises(ValueError, match="local attention"):
        attend_fwd(q, k, v, scale=0.1, mask=mask)


@pytest.mark.parametrize("name", ["flash", "cudnn", "efficient"])
def test_cuda_adapters_plumbing_on_meta(name):
    """The aten SDPA adapters turn their kernel's conventions into the registry's (lse (B, H, S)
    fp32, K/V gradients with H_kv heads: cuDNN's own GQA sums in bf16, the others' expanded
    heads folded in fp32), for an S not a multiple of 32."""
    from torch_commopt.kernels.attention import fused  # noqa: F401  (registers the CUDA adapters)

    b, h, h_kv, s, d = 2, 4, 2, 40, 64
    q, dout = (torch.empty(b, h, s, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty(b, h_kv, s, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    backend = backends()[name]
    out, lse = backend.fwd(q, k, v, 0.125, True)
    assert out.shape == q.shape and lse.shape == (b, h, s) and lse.dtype == torch.float32
    dq, dk, dv = backend.bwd(dout, q, k, v, out, lse, 0.125, True)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert dk.dtype == dv.dtype == (torch.bfloat16 if name == "cudnn" else torch.float32)
    assert backend.why_not(q, k) == "not a CUDA tensor"


def test_acc_dtype_follows_float64_only():
    assert local.acc_dtype(torch.float64) == torch.float64
    assert {local.acc_dtype(t) for t in (torch.float32, torch.bfloat16, torch.float16)} == {torch.float32}
