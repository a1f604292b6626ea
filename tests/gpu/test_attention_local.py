"""The CUDA local-attention backends (kernels/attention/fused.py) against the math reference, on one GPU.

Every schedule calls these block kernels, so each is checked for what the schedules rely on:
forward out and lse, backward given an lse (the merged, global one), GQA (K/V unexpanded,
dK/dV folded back to H_kv heads), head dims 64 and 128, lengths not a multiple of the
kernels' tiles, and a causal query range split into blocks whose merged results equal the
whole.  Fresh random inputs; tolerances relative to the error of the same computation done
by eager SDPA in the same dtype (the reference's own error).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torch_commopt.kernels.attention.local import attend_bwd, attend_fwd, backends, pick
from torch_commopt.kernels.attention.merge import empty_accumulator, merge_
from torch_commopt.testing.validate import rel_err, within_tolerance

CUDA_BACKENDS = ("flash", "cudnn", "efficient", "flash_attn")


def _inputs(seed, dtype, b=2, h=8, h_kv=2, s=333, d=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32).to(dtype)  # noqa: E731
    return mk(b, h, s, d), mk(b, h_kv, s, d), mk(b, h_kv, s, d), mk(b, h, s, d)


def _eager(q, k, v, dout, causal, scale):
    """Eager SDPA's out and gradients (the figure a user compares with)."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)


def _usable(name, q, k):
    pick(q, k)  # the first CUDA call registers the CUDA backends (fused.py)
    backend = backends().get(name)
    reason = "not registered" if backend is None else backend.why_not(q, k)
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return name


@pytest.mark.parametrize("name", CUDA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,heads,d,s", [(True, (8, 2), 128, 333), (False, (8, 8), 64, 1000),
                                              (True, (32, 8), 128, 1024), (False, (4, 1), 128, 77)])
def test_backend_matches_math(one_gpu, name, dtype, causal, heads, d, s):
    q, k, v, dout = _inputs(hash((name, causal, d, s)) % 1000, dtype, h=heads[0], h_kv=heads[1], s=s, d=d)
    _usable(name, q, k)
    scale, mask = d ** -0.5, "causal" if causal else "full"
    f32 = [t.float() for t in (q, k, v, dout)]
    truth = attend_fwd(*f32[:3], scale=scale, mask=mask, backend="math")
    truth_g = attend_bwd(f32[3], (*f32[:3], *truth), scale=scale, mask=mask, backend="math")
    ref = _eager(q, k, v, dout, causal, scale)  # eager SDPA in the same dtype: the error allowed
    out, lse = attend_fwd(q, k, v, scale=scale, mask=mask, backend=name)
    grads = attend_bwd(dout, (q, k, v, out, lse), scale=scale, mask=mask, backend=name)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert {g.dtype for g in grads} <= {torch.float32, dtype}  # the kernel's, or folded GQA heads in fp32
    assert rel_err(lse, truth[1]) < 1e-3
    for what, got, want, eager in zip(("out", "dq", "dk", "dv"), (out,) + grads, (truth[0],) + truth_g, ref):
        assert within_tolerance(rel_err(got, want), rel_err(eager, want)), (name, what)


@pytest.mark.parametrize("name", CUDA_BACKENDS)
def test_blocks_merged_by_lse_equal_the_whole(one_gpu, name):
    """A causal sequence of 3 chunks done as ring blocks (diagonal causal, past full) and merged,
    forward and backward with the merged lse, equals the whole-sequence attention."""
    q, k, v, dout = _inputs(7, torch.bfloat16, h=8, h_kv=4, s=3 * 256, d=128)
    _usable(name, q, k)
    scale, c = 128 ** -0.5, 256
    whole = attend_fwd(q, k, v, scale=scale, mask="causal", backend=name)
    whole_g = attend_bwd(dout, (q, k, v, *whole), scale=scale, mask="causal", backend=name)
    out, lse = empty_accumulator(q, 128, torch.float32)
    blocks = [(i, j, "causal" if i == j else "full") for i in range(3) for j in range(i + 1)]
    chunk = lambda t, i: t[:, :, i * c:(i + 1) * c]  # noqa: E731
    for i, j, mask in blocks:
        merge_(chunk(out, i), chunk(lse, i), *attend_fwd(chunk(q, i), chunk(k, j), chunk(v, j), scale=scale,
                                                          mask=mask, backend=name))
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    for i, j, mask in blocks:
        saved = (chunk(q, i), chunk(k, j), chunk(v, j), chunk(out, i), chunk(lse, i).contiguous())
        g = attend_bwd(chunk(dout, i), saved, scale=scale, mask=mask, backend=name)
        chunk(dq, i).add_(g[0])
        chunk(dk, j).add_(g[1])
        chunk(dv, j).add_(g[2])
    assert rel_err(lse, whole[1]) < 1e-4
    assert rel_err(out, whole[0]) < 2e-2
    for got, want in zip((dq, dk, dv), whole_g):
        assert rel_err(got, want) < 3e-2


def test_a_half_first_partial_takes_its_last_merge_in_place(one_gpu):
    """A zigzag rank's forward at world 2 -- the diagonal causal block, then its second query
    chunk (a strided slice, passed to cuDNN uncopied) against another rank's keys: the bf16
    first partial merged in place by the Triton kernel equals the fp32-accumulated result to
    within bf16 rounding, and stays bf16."""
    from torch_commopt.kernels.attention.merge import Accumulator

    q, k, v, _ = _inputs(9, torch.bfloat16, h=8, h_kv=2, s=512)
    _, k2, v2, _ = _inputs(10, torch.bfloat16, h=8, h_kv=2, s=512)
    scale, rows = 128 ** -0.5, slice(256, 512)
    a = attend_fwd(q, k, v, scale=scale, mask="causal")
    b = attend_fwd(q[:, :, rows], k2, v2, scale=scale, mask="full")
    ref = Accumulator(q, 128, torch.float32)
    ref.add(slice(None), a[0].float(), a[1])
    ref.add(rows, *b)
    acc = Accumulator(q, 128, torch.float32)
    acc.add(slice(None), a[0].clone(), a[1])
    acc.add(rows, *b, last=True)
    out, lse = acc.result()
    assert out.dtype == torch.bfloat16 and ref.out.dtype == torch.float32
    assert rel_err(out, ref.out) <= 1.5 * rel_err(ref.out.bfloat16(), ref.out)
    assert rel_err(lse, ref.lse) < 1e-6


def test_auto_picks_a_fused_kernel_on_cuda(one_gpu):
    q, k, _, _ = _inputs(11, torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pick(q, k).name == ("cudnn" if hopper else "flash")  # flash_attn is not on the device machine
    assert pick(q.float(), k.float()).name in ("efficient", "math")  # flash/cuDNN take half types only


def test_triton_merge_matches_the_torch_merge(one_gpu):
    """merge_triton (what merge_ runs on CUDA) against the torch formula in fp64: a bf16 partial
    into an fp32 accumulator viewed as a slice of the sequence dim, rows empty on either or both
    sides, 200 back-to-back calls."""
    from torch_commopt.kernels.attention import merge_triton
    from torch_commopt.kernels.attention.merge import merge_

    gen = torch.Generator(device="cuda").manual_seed(5)
    for d in (64, 128, 96):
        full_out = torch.randn(2, 4, 300, d, device="cuda", generator=gen)
        full_lse = torch.randn(2, 4, 300, device="cuda", generator=gen) * 3
        out, lse = full_out[:, :, 100:250], full_lse[:, :, 100:250]  # strided views
        out_b = torch.randn(2, 4, 150, d, device="cuda", generator=gen).to(torch.bfloat16)
        lse_b = torch.randn(2, 4, 150, device="cuda", generator=gen) * 3
        lse[:, :, :10] = float("-inf")
        out[:, :, :10] = 0
        lse_b[:, :, 5:15] = float("-inf")
        assert merge_triton.fits(out, lse, out_b, lse_b)
        ref_out, ref_lse = out.double().clone(), lse.double().clone()
        merge_(ref_out, ref_lse, out_b.double(), lse_b.double())  # fp64: the torch path
        before = full_out.clone()
        merge_triton.merge_(out, lse, out_b, lse_b)  # the kernel itself (merge_ would fall back)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        assert torch.isfinite(out).all() and (out[:, :, 5:10] == 0).all()  # both sides empty: stays 0
        finite = ~torch.isneginf(ref_lse)
        assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-5
        assert rel_err(out, ref_out) < 1e-6
        assert torch.equal(full_out[:, :, :100], before[:, :, :100]) and torch.equal(full_out[:, :, 250:],
                                                                                      before[:, :, 250:])
    acc_out, acc_lse = out.clone(), lse.clone()
    ref_out, ref_lse = acc_out.double(), acc_lse.double()
    for _ in range(200):
        ob = torch.randn_like(out_b)
        lb = torch.randn_like(lse_b)
        merge_triton.merge_(acc_out, acc_lse, ob, lb)
        merge_(ref_out, ref_lse, ob.double(), lb.double())
    assert rel_err(acc_out, ref_out) < 1e-5 and rel_err(acc_lse, ref_lse) < 1e-6
