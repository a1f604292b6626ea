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

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)
_TRITON_BROKEN = False  # set once the Triton merge kernel fails to build or launch here


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Merge the partial (out_b, lse_b) into the accumulator (out, lse), in place.

    out: (B, H, S, D) in the acc dtype (float32, float64 for a float64 run), or half precision
        for a last merge (computed in float32, rounded once); may be a view (a slice of the
        sequence dim); out_b: (B, H, S, D), any floating dtype (bf16 from a fused kernel).
    lse, lse_b: (B, H, S) in the acc dtype.
    Returns (out, lse), the same tensors.  On CUDA one Triton kernel does it (merge_triton.py).
    """
    global _TRITON_BROKEN
    if out.is_cuda and not _TRITON_BROKEN:
        from torch_commopt.kernels.attention import merge_triton

        if merge_triton.fits(out, lse, out_b, lse_b):
            try:
                return merge_triton.merge_(out, lse, out_b, lse_b)
            except Exception as exc:  # noqa: BLE001  (a Triton build failure: the torch formula does it)
                _TRITON_BROKEN = True
                log.warning("attention merge: the Triton kernel failed (%s: %s); using the torch formula from now on",
                            type(exc).__name__, exc)
    return _merge_torch(out, lse, out_b, lse_b)


def _merge_torch(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """merge_ in torch ops: CPU, dtypes other than float32, and the Triton kernel's reference."""
    if out.dtype != lse.dtype:  # a half-precision accumulator (a last merge): the math in lse's dtype
        wide = out.to(lse.dtype)
        _merge_torch(wide, lse, out_b, lse_b)
        out.copy_(wide)
        return out, lse
    both_empty = torch.isneginf(lse) & torch.isneginf(lse_b)
    # lse_b - lse is +inf where only the accumulator is empty (weight 1 on out_b), -inf where
    # only the partial is (weight 0), and NaN where both are: weight 0 there (out stays as it
    # is, whatever a kernel left in out_b's fully masked rows).
    diff = torch.where(both_empty, torch.zeros_like(lse), lse_b - lse)
    weight = torch.where(both_empty, torch.zeros_like(lse), torch.sigmoid(diff))
    out.sub_(weight.unsqueeze(-1) * (out - out_b))
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


class Accumulator:
    """The merged (out, lse) of one query block over the K/V blocks seen so far.

    add(qs, out_b, lse_b, last) merges a partial for the query rows qs (a slice of the sequence
    dim).  The first partial that covers all rows becomes the accumulator (the caller hands it
    over: a fresh kernel output): a half-precision one stays as it is until a merge that is not
    the last needs the acc dtype, so a query block that gets one merge (a ring of two ranks)
    merges in place, in float32 registers, rounded once -- no conversion passes.  Any other
    first partial is copied into the acc dtype; a first partial over some rows starts from an
    empty accumulator.  result() gives out (the acc dtype, or the half partial's) and lse (the
    acc dtype).
    """

    def __init__(self, q: Tensor, head_dim_v: int, dtype: torch.dtype) -> None:
        self._q, self._dv, self._dtype = q, head_dim_v, dtype
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def add(self, qs: slice, out_b: Tensor, lse_b: Tensor, last: bool = False) -> None:
        if self.out is None and qs == slice(None):
            keep = out_b.dtype in (torch.float16, torch.bfloat16) and out_b.is_contiguous()
            self.out = out_b if keep else out_b.to(self._dtype, memory_format=torch.contiguous_format, copy=True)
            self.lse = lse_b.to(self._dtype, copy=True).contiguous()
            return
        if self.out is None:
            self.out, self.lse = empty_accumulator(self._q, self._dv, self._dtype)
        elif self.out.dtype != self._dtype and not last:
            self.out = self.out.to(self._dtype)  # more merges follow: accumulate in the acc dtype
        merge_(self.out[:, :, qs], self.lse[:, :, qs], out_b, lse_b)

    def result(self) -> tuple[Tensor, Tensor]:
        if self.out is None:
            self.out, self.lse = empty_accumulator(self._q, self._dv, self._dtype)
        return self.out, self.lse
