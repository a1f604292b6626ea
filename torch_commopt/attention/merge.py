"""Merging partial attention results by their log-sum-exp (ring attention's combine step).

Two partials of the same queries over disjoint key sets, (out_a, lse_a) and (out_b, lse_b),
combine into the attention over the union of the keys:

    lse = log(exp(lse_a) + exp(lse_b))
    out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / exp(lse)

computed in the stable form of zhuzilin/ring-flash-attention#34 (what torch's own context
parallelism uses): `out -= sigmoid(lse_b - lse) * (out - out_b)`, `lse -= logsigmoid(lse - lse_b)`.
A row no key reached has lse = -inf (an accumulator before its first block, or a fully masked
row); the merge then takes the other side as is, and two -inf sides stay (0, -inf), never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge the partial (out_b, lse_b) into the accumulator (out, lse), in place.

    out: (B, H, S, D) float32 (float64 for a float64 run), may be a view (a slice of the
        sequence dim); out_b: (B, H, S, D), any floating dtype (bf16 from a fused kernel).
    lse, lse_b: (B, H, S) in out's dtype.
    Returns (out, lse), the same tensors.
    """
    both_empty = torch.isneginf(lse) & torch.isneginf(lse_b)
    # lse_b - lse is +inf where only the accumulator is empty (weight 1 on out_b), -inf where
    # only the partial is (weight 0), and NaN where both are: set to 0 there (out stays 0).
    diff = torch.where(both_empty, torch.zeros_like(lse), lse_b - lse)
    out.sub_(torch.sigmoid(diff).unsqueeze(-1) * (out - out_b))
    merged = torch.where(torch.isneginf(lse), lse_b, lse - F.logsigmoid(-diff))
    lse.copy_(merged)
    return out, lse


def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The merge of two partials as new tensors, in out_a's dtype promoted to float32.

    out_a, out_b: (B, H, S, D); lse_a, lse_b: (B, H, S).  Returns (out, lse)."""
    acc = torch.promote_types(out_a.dtype, torch.float32)
    out, lse = out_a.to(acc, copy=True), lse_a.to(acc, copy=True)
    return merge_(out, lse, out_b, lse_b.to(acc))


def empty_accumulator(q: Tensor, head_dim_v: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out, lse) holding no keys yet: zeros (B, H, S, Dv) and -inf (B, H, S), in `dtype`."""
    b, h, s, _ = q.shape
    out = torch.zeros(b, h, s, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=dtype, device=q.device)
    return out, lse
