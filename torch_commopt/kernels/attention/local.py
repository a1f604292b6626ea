"""Attention of a query block against one key/value block: the kernel every schedule calls.

A ring schedule sees, at each step, one K/V block that is entirely in the queries' past
("full"), the diagonal block ("causal": query i sees key j <= i, square blocks at the same
offset), or entirely in their future ("skip").  The forward returns the block's output and
its log-sum-exp, so blocks can be merged (merge.py); the backward takes the GLOBAL output
and lse (of all blocks merged), which makes the per-block gradients exact (flash backward):

    delta = rowsum(dout * out),  p = exp(s - lse),  dp = dout @ v^T,  ds = p * (dp - delta)
    dq = scale * ds @ k,  dk = scale * ds^T @ q,  dv = p^T @ dout

GQA: q has H heads, k/v have H_kv (dividing H); query head h reads kv head h // (H / H_kv).
K/V travel unexpanded; a kernel without GQA support expands them locally (fused.py).

Backends (a registry, `backend="auto"` picks the first that takes the call):
    math      fp32 (fp64 for fp64 inputs) matmuls + softmax; any device, dtype, head dim; the
              reference, and the default on CPU.
    cpu_flash aten's CPU flash kernel; by name only (tested against math).
    on CUDA (fused.py, imported on first CUDA call): cuDNN, flash_attn (if importable), aten
              flash, memory-efficient on Hopper; flash_attn and flash before cuDNN on older
              GPUs (cuda_order).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from torch_commopt.kernels.attention.backends import REGISTRY, LocalBackend, backends, register  # noqa: F401 (local's API)

MASKS = ("full", "causal", "skip")
# backend="auto" on CUDA: the first that takes the call.  On Hopper (sm90+) cuDNN's kernels are
# ~1.7x faster than aten's flash (FlashAttention-2) in both passes: H200, torch 2.11, cuDNN 9.19,
# B1 H32 D128 bf16 S 16K-128K, fwd+bwd 14.4 vs 24.2 ms (16K causal), 432 vs 748 ms (64K full);
# docs/context-parallel-attention.md, "Local attention kernels".  Before sm90 flash comes first.
CUDA_ORDER = ("flash_attn", "flash", "cudnn", "efficient", "math")
CUDA_ORDER_SM90 = ("cudnn", "flash_attn", "flash", "efficient", "math")


def cuda_order(device: torch.device) -> tuple[str, ...]:
    """The order backend="auto" tries the CUDA backends in, for this device's architecture."""
    return _cuda_order(torch.device(device).index if torch.device(device).index is not None
                       else torch.cuda.current_device())


@functools.cache
def _cuda_order(index: int) -> tuple[str, ...]:  # once per device: pick() runs per block
    return CUDA_ORDER_SM90 if torch.cuda.get_device_capability(index) >= (9, 0) else CUDA_ORDER


class Saved(NamedTuple):
    """What an attention backward takes of its forward: q, k, v and the forward's out and lse
    (for a block's gradients: the GLOBAL out and lse of q's rows).  Any 5-sequence in this order
    does; the backward entries unpack it."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of partial outputs, lse and dK/dV: float32, float64 for a float64 run."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def pick(q: Tensor, k: Tensor, name: str = "auto") -> LocalBackend:
    """The backend that runs a block: `name`, or with "auto" the first of cuda_order() that
    takes a CUDA call, math elsewhere.  Raises ValueError for an unknown or unfit name."""
    if q.device.type == "cuda" or (name != "auto" and name not in REGISTRY):
        from torch_commopt.kernels.attention import fused  # noqa: F401  (registers the CUDA backends)
    if name == "auto":
        if q.device.type != "cuda":
            return REGISTRY["math"]
        for candidate in cuda_order(q.device):
            b = REGISTRY.get(candidate)
            if b is not None and b.auto and b.why_not(q, k) is None:
                return b
        return REGISTRY["math"]
    if name not in REGISTRY:
        raise ValueError(f"local attention backend: unknown {name!r}; known: {sorted(REGISTRY)}")
    reason = REGISTRY[name].why_not(q, k)
    if reason is not None:
        raise ValueError(f"local attention backend {name!r} cannot take this call: {reason}")
    return REGISTRY[name]


def _check(q: Tensor, k: Tensor, v: Tensor, mask: str) -> None:
    if mask not in MASKS:
        raise ValueError(f"local attention: mask must be one of {MASKS}, got {mask!r}")
    if (q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0]
            or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]):
        raise ValueError(f"local attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
                         "(B, H, S_q, D), (B, H_kv, S_k, D), (B, H_kv, S_k, Dv) with H_kv dividing H")
    if mask == "causal" and q.shape[2] != k.shape[2]:
        raise ValueError(f"local attention: a causal block is square, got S_q={q.shape[2]}, S_k={k.shape[2]}")


def attend_fwd(q: Tensor, k: Tensor, v: Tensor, *, scale: float, mask: str = "full",
               backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Attention of q against one K/V block.

    q: (B, H, S_q, D); k: (B, H_kv, S_k, D); v: (B, H_kv, S_k, Dv); mask: "full", "causal"
    (square diagonal block) or "skip" (no key visible).
    Returns out (B, H, S_q, Dv), in q's dtype or the acc dtype (backend's choice: the merge
    takes either), and lse (B, H, S_q) in the acc dtype; "skip" gives zeros and -inf.
    """
    _check(q, k, v, mask)
    acc = acc_dtype(q.dtype)
    if mask == "skip":
        b, h, s, _ = q.shape
        return q.new_zeros(b, h, s, v.shape[-1], dtype=acc), q.new_full((b, h, s), float("-inf"), dtype=acc)
    out, lse = pick(q, k, backend).fwd(q, k, v, scale, mask == "causal")
    return out, lse.to(acc)


def attend_bwd(dout: Tensor, saved: Saved, *, scale: float, mask: str = "full",
               backend: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block, given saved = (q, k, v, out, lse) with the GLOBAL out and lse of
    q's rows (all blocks merged).

    dout, out: (B, H, S_q, Dv); q: (B, H, S_q, D); k: (B, H_kv, S_k, D); v: (B, H_kv, S_k, Dv);
    lse: (B, H, S_q).  Returns dq (B, H, S_q, D), dk, dv (B, H_kv, S_k, *) as the kernel gives
    them -- the acc dtype, or the inputs' dtype (a fused kernel's bf16 output, which the acc
    dtype holds exactly) -- to be summed in the acc dtype over the blocks (dq) and over the
    query blocks that saw this K/V (dk, dv): callers add them into acc-dtype buffers, which
    converts on the fly instead of in a separate pass.
    """
    q, k, v, out, lse = saved
    _check(q, k, v, mask)
    acc = acc_dtype(q.dtype)
    if mask == "skip":
        return (torch.zeros_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
    return tuple(pick(q, k, backend).bwd(dout, q, k, v, out, lse, scale, mask == "causal"))


# ---- math: the reference path ---------------------------------------------------------------

def _grouped(q: Tensor, k: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Views in the acc dtype with the GQA group as its own dim: q-like (B, H_kv, G, S, *),
    k-like (B, H_kv, 1, S, *) (broadcast over G: K/V are never materialized per query head)."""
    acc = acc_dtype(q.dtype)
    b, h, _, _ = q.shape
    h_kv = k.shape[1]
    out = []
    for t in tensors:
        t = t.to(acc)
        out.append(t.unflatten(1, (h_kv, h // h_kv)) if t.shape[1] == h else t.unsqueeze(2))
    return tuple(out)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    """(B, H_kv, G, S_q, S_k) scaled scores of grouped q, k; -inf above the diagonal if causal."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _math_fwd(q, k, v, scale, causal):
    qg, kg, vg = _grouped(q, k, q, k, v)
    s = _scores(qg, kg, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vg)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_bwd(dout, q, k, v, out, lse, scale, causal):
    qg, kg, vg, dog, og, lg = _grouped(q, k, q, k, v, dout, out, lse)
    p = torch.exp(_scores(qg, kg, scale, causal) - lg.unsqueeze(-1))
    delta = (dog * og).sum(-1, keepdim=True)
    ds = p * (torch.matmul(dog, vg.transpose(-1, -2)) - delta)
    dq = torch.matmul(ds, kg).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale)
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    return dq.flatten(1, 2), dk, dv


def _math_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    return None if q.is_floating_point() else f"dtype {q.dtype} is not floating"


register(LocalBackend("math", _math_fwd, _math_bwd, _math_why_not))
