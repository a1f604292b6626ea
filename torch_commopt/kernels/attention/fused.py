"""Fused block-attention backends: aten's SDPA kernels that return the log-sum-exp, and flash-attn.

Imported on the first call that can use them (a CUDA tensor, or a backend asked for by name),
never at package import: the availability checks below query CUDA.  Each adapter turns its
kernel's conventions into the registry's (local.py): lse (B, H, S_q) in float32, K/V with
H_kv heads (expanded locally to H for kernels without GQA, their gradients summed back in
float32), and backward given the global out and lse.

Conventions of the kernels (DESIGN.md section 4):
    flash      lse (B, H, S) fp32; sm80+, fp16/bf16, head dim % 8 == 0 and <= 256.
    cudnn      lse (B, H, S, 1): squeezed here, unsqueezed for its backward; GQA natively
               (K/V expanded only where a build refuses that).
    efficient  lse (B, H, ceil(S/32)*32): sliced to S here, padded again for its backward.
    flash_attn (B, S, H, D) layout, GQA natively, lse (B, H, S); its backward's signature
               varies across releases (filled by parameter name).
    cpu_flash  aten's CPU flash kernel; by name only (the math path is CPU's default).
The CUDA adapters cannot run on the CPU CI; their argument plumbing is checked on meta
tensors (tests/attention/test_local.py) and their numerics on the device machine.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_commopt.kernels.attention.backends import LocalBackend, register

aten = torch.ops.aten
log = logging.getLogger(__name__)
HALF = (torch.float16, torch.bfloat16)


def _expand(kv: Tensor, heads: int, layout=Tensor.contiguous) -> Tensor:
    """K or V with its H_kv heads repeated to `heads` (query head h reads kv head h // G),
    else `layout(kv)` (contiguous, or _rows for a kernel that takes strided operands)."""
    g = heads // kv.shape[1]
    return layout(kv) if g == 1 else kv.repeat_interleave(g, dim=1)


def _rows(x: Tensor) -> Tensor:
    """x (B, H, S, D) as is when each (b, h, s) row is contiguous (a slice of a contiguous
    tensor along S: what a ring step's query or key range is), else a contiguous copy.  cuDNN
    takes such strides (checked against contiguous operands in tests/gpu/test_attention_local.py);
    skipping the copy saves a pass over the block per call."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _fold(grad: Tensor, kv_heads: int) -> Tensor:
    """(B, H, S, D) gradient of expanded K/V -> (B, H_kv, S, D), summed over each group in fp32;
    without expansion the kernel's gradient as it is (the caller's fp32 sum converts it)."""
    b, h, s, d = grad.shape
    if h == kv_heads:
        return grad
    return (grad.float() if grad.dtype in HALF else grad).view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _cuda_why_not(q: Tensor, dtypes: tuple[torch.dtype, ...], max_dim: int) -> Optional[str]:
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in dtypes:
        return f"dtype {q.dtype} (takes {dtypes})"
    d = q.shape[-1]
    if d % 8 or d > max_dim:
        return f"head dim {d} (needs a multiple of 8, at most {max_dim})"
    return None


def _sm80(q: Tensor) -> bool:
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


# ---- aten flash -----------------------------------------------------------------------------

def _flash_fwd(q, k, v, scale, causal):
    h = q.shape[1]
    out, lse = aten._scaled_dot_product_flash_attention(q.contiguous(), _expand(k, h), _expand(v, h), 0.0, causal,
                                                         False, scale=scale)[:2]
    return out, lse


def _flash_bwd(dout, q, k, v, out, lse, scale, causal):
    h, h_kv = q.shape[1], k.shape[1]
    # Without dropout the rng state is never read; these mimic the forward's (2,) / () outputs.
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), _expand(k, h), _expand(v, h), out.to(q.dtype).contiguous(),
        lse.float().contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq, _fold(dk, h_kv), _fold(dv, h_kv)


def _flash_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    reason = _cuda_why_not(q, HALF, 256)
    if reason is None and not (torch.backends.cuda.flash_sdp_enabled() and _sm80(q)):
        reason = "flash SDPA disabled or not built for this GPU"
    return reason


# ---- cuDNN ----------------------------------------------------------------------------------

# aten's cuDNN ops take K/V with H_kv < H heads directly (GQA: H200, torch 2.11, cuDNN 9.19,
# H 32 / H_kv 8, S 8K causal: out identical, dK/dV the kernel's bf16 group sums, fwd+bwd
# 3.92 vs 4.18 ms with expanded K/V before the fp32 fold; docs/context-parallel-attention.md).
# Where a build refuses, the adapter expands from then on (logged once).
_CUDNN_GQA = True


def _cudnn_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    h = q.shape[1]
    if _CUDNN_GQA:
        return _rows(k), _rows(v)
    return _expand(k, h, _rows), _expand(v, h, _rows)


def _gqa_refused(q: Tensor, k: Tensor, exc: Exception) -> bool:
    """Whether exc is a refusal of unexpanded GQA heads (then switch to expanding)."""
    global _CUDNN_GQA
    if not (_CUDNN_GQA and k.shape[1] != q.shape[1] and isinstance(exc, RuntimeError)):
        return False
    _CUDNN_GQA = False
    log.warning("cuDNN attention refused K/V with %d of %d heads (%s); expanding K/V from now on",
                k.shape[1], q.shape[1], str(exc).splitlines()[0][:200])
    return True


def _cudnn_fwd(q, k, v, scale, causal):
    try:
        res = aten._scaled_dot_product_cudnn_attention(_rows(q), *_cudnn_kv(q, k, v), None, True, 0.0, causal, False,
                                                       scale=scale)
    except RuntimeError as exc:
        if not _gqa_refused(q, k, exc):
            raise
        return _cudnn_fwd(q, k, v, scale, causal)
    return res[0], res[1].squeeze(-1)  # lse (B, H, S, 1) -> (B, H, S)


def _cudnn_bwd(dout, q, k, v, out, lse, scale, causal):
    h_kv = k.shape[1]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout seed/offset: unused at p=0
    kk, vv = _cudnn_kv(q, k, v)
    try:
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            _rows(dout.to(q.dtype)), _rows(q), kk, vv, _rows(out.to(q.dtype)), lse.float().unsqueeze(-1).contiguous(),
            zero, zero, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    except RuntimeError as exc:
        if not _gqa_refused(q, k, exc):
            raise
        return _cudnn_bwd(dout, q, k, v, out, lse, scale, causal)
    return dq, _fold(dk, h_kv), _fold(dv, h_kv)  # unexpanded: already H_kv heads (fold is a no-op)


def _cudnn_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    reason = _cuda_why_not(q, HALF, 128)
    if reason is None and not (torch.backends.cuda.cudnn_sdp_enabled() and _sm80(q)):
        reason = "cuDNN SDPA disabled or unsupported on this GPU"
    return reason


# ---- memory-efficient -----------------------------------------------------------------------

def _efficient_fwd(q, k, v, scale, causal):
    h = q.shape[1]
    out, lse = aten._scaled_dot_product_efficient_attention(q.contiguous(), _expand(k, h), _expand(v, h), None, True,
                                                            0.0, causal, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # its lse is padded to a multiple of 32 rows


def _bshd_memory(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (B, H, S, D) as a view of (B, S, H, D)-contiguous memory: the layout the kernel's own
    forward returns out in, and the one its backward reads out and dout in."""
    return x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


def _efficient_bwd(dout, q, k, v, out, lse, scale, causal):
    h, h_kv, s = q.shape[1], k.shape[1], q.shape[2]
    padded = F.pad(lse.float(), (0, -s % 32)).contiguous()  # the shape its forward returned
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        _bshd_memory(dout, q.dtype), _bshd_memory(q, q.dtype), _bshd_memory(_expand(k, h), q.dtype),
        _bshd_memory(_expand(v, h), q.dtype), None, _bshd_memory(out, q.dtype), padded, zero, zero, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, _fold(dk, h_kv), _fold(dv, h_kv)


def _efficient_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    reason = _cuda_why_not(q, HALF + (torch.float32,), 1 << 16)
    if reason is None and not torch.backends.cuda.mem_efficient_sdp_enabled():
        reason = "memory-efficient SDPA disabled"
    return reason


# ---- flash-attn (the package) ---------------------------------------------------------------

def _bshd(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype).transpose(1, 2).contiguous()


def _fa_fwd(q, k, v, scale, causal):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(_bshd(q, q.dtype), _bshd(k, q.dtype), _bshd(v, q.dtype), dropout_p=0.0,
                                  softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out.transpose(1, 2), lse


def _fa_bwd(dout, q, k, v, out, lse, scale, causal):
    from flash_attn import flash_attn_interface as fai

    qt, kt, vt = _bshd(q, q.dtype), _bshd(k, q.dtype), _bshd(v, q.dtype)
    dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
    params = inspect.signature(fai._flash_attn_backward).parameters
    named = {"dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "window_size": (-1, -1),
             "window_size_left": -1, "window_size_right": -1, "softcap": 0.0, "alibi_slopes": None,
             "deterministic": False, "rng_state": None}
    fai._flash_attn_backward(_bshd(dout, q.dtype), qt, kt, vt, _bshd(out, q.dtype), lse.float().contiguous(), dq, dk, dv,
                             **{key: val for key, val in named.items() if key in params})
    return dq.transpose(1, 2), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()


def _fa_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    reason = _cuda_why_not(q, HALF, 256)
    if reason is None and importlib.util.find_spec("flash_attn") is None:
        reason = "flash_attn is not installed"
    return reason


# ---- aten CPU flash -------------------------------------------------------------------------

def _cpu_flash_fwd(q, k, v, scale, causal):
    h = q.shape[1]
    return aten._scaled_dot_product_flash_attention_for_cpu(q.contiguous(), _expand(k, h), _expand(v, h), 0.0, causal,
                                                            scale=scale)


def _cpu_flash_bwd(dout, q, k, v, out, lse, scale, causal):
    h, h_kv = q.shape[1], k.shape[1]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).contiguous(), q.contiguous(), _expand(k, h), _expand(v, h), out.to(q.dtype).contiguous(),
        lse.to(lse_dtype).contiguous(), 0.0, causal, scale=scale)
    return dq, _fold(dk, h_kv), _fold(dv, h_kv)


def _cpu_flash_why_not(q: Tensor, k: Tensor) -> Optional[str]:
    if q.device.type != "cpu":
        return "not a CPU tensor"
    return None if q.dtype in HALF + (torch.float32, torch.float64) else f"dtype {q.dtype}"


register(LocalBackend("flash_attn", _fa_fwd, _fa_bwd, _fa_why_not))
register(LocalBackend("flash", _flash_fwd, _flash_bwd, _flash_why_not))
register(LocalBackend("cudnn", _cudnn_fwd, _cudnn_bwd, _cudnn_why_not))
register(LocalBackend("efficient", _efficient_fwd, _efficient_bwd, _efficient_why_not))
register(LocalBackend("cpu_flash", _cpu_flash_fwd, _cpu_flash_bwd, _cpu_flash_why_not, auto=False))
