"""The distributed decoding attention's reference (kernels/attention/decode.py) on gloo at 2 and 4
ranks, float64: one and three queries, GQA, no mask, a prefix mask that leaves the later ranks'
shares fully masked for some rows, an additive mask; against attention over the whole cache, and
the same result on every rank."""

from __future__ import annotations

import pytest
from decode_programs import run_decode

from torch_commopt.testing.launch import run_distributed


@pytest.mark.parametrize("world", [2, 4])
def test_partial_attentions_merged_by_lse_equal_attention_over_the_whole_cache(world):
    per_rank = run_distributed(run_decode, world, backend="gloo", timeout_s=300)
    assert len(per_rank[0]) == 6
    for results in per_rank:
        for (case, err, got), (_, _, got0) in zip(results, per_rank[0]):
            assert err <= 1e-12, (case, err)
            assert got == got0, f"{case}: ranks differ"


def test_a_local_share_with_every_key_masked_gives_an_empty_partial():
    import torch

    from torch_commopt.kernels.attention.decode import local_partial

    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 5)
    out, lse = local_partial(q, k, v, torch.zeros(1, 1, 1, 3, dtype=torch.bool), 0.5)
    assert torch.isneginf(lse).all() and not out.any()


SPLIT_KV_CHECK = """
import math, torch
from torch_commopt.kernels.attention import decode_triton
from torch_commopt.kernels.attention.decode import local_partial
g = torch.Generator().manual_seed(11)
worst = {}
# (B, H, H_kv, S_q, S_loc, D, Dv, dtype, mask): GQA 4:1 and 1:1, several splits and a ragged last
# block, masks broadcast over heads or over everything, a row with no key, every key masked
cases = [(2, 4, 2, 1, 150, 16, 16, torch.float32, None), (1, 8, 2, 3, 200, 32, 16, torch.float16, "bool"),
         (2, 4, 4, 2, 70, 16, 32, torch.float16, "float"), (1, 2, 1, 1, 100, 16, 16, torch.float32, "none attended"),
         (3, 4, 1, 5, 333, 64, 64, torch.float32, "bool")]
for b, h, hkv, sq, s, d, dv, dt, kind in cases:
    q = torch.randn(b, h, sq, d, generator=g).to(dt)
    k, v = torch.randn(b, hkv, s, d, generator=g).to(dt), torch.randn(b, hkv, s, dv, generator=g).to(dt)
    mask = None
    if kind == "bool":
        mask = torch.rand(b, 1, sq, s, generator=g) > 0.3
        mask[0, 0, 0] = False  # this row attends nothing
    elif kind == "float":
        mask = torch.randn(s, generator=g)
    elif kind == "none attended":
        mask = torch.zeros(sq, s, dtype=torch.bool)
    scale = 1 / math.sqrt(d)
    out, lse = decode_triton.partial(q, k, v, mask, scale)
    ref_out, ref_lse = local_partial(q, k, v, mask, scale)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), kind
    assert not out[torch.isneginf(ref_lse)].any()
    fin = ~torch.isneginf(ref_lse)
    # the reference's own error in the operands' dtype: its output rounded to it
    own = float((ref_out.to(dt).float() - ref_out).abs().max()) if dt != torch.float32 else 1e-6
    err = float((out - ref_out).abs().max())
    lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
    assert err <= 4 * own + 1e-6 and lse_err <= 1e-4, (b, h, hkv, sq, s, dt, kind, err, own, lse_err)
    worst[str(dt)] = max(worst.get(str(dt), 0.0), err)
print("ok", worst)
"""


def test_split_kv_kernel_in_the_interpreter_matches_the_reference_partial(triton_interpreter):
    """decode_triton.partial (the CUDA local attention) in Triton's CPU interpreter against
    local_partial: fp32 and fp16 (bf16's tensor-core dot is wrong in the interpreter of Triton 3.9,
    a 16x16 bf16 tl.dot alone is off by 1e10 there: bf16 runs in tests/gpu/test_decode_gpu.py)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", SPLIT_KV_CHECK], env=triton_interpreter, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]
