"""A rank's partial decoding attention on CUDA: a split-KV Triton kernel (flash-decoding).

Decoding has a few queries and a long cache: one program per (batch, KV head) would leave most
SMs idle and read the cache at a fraction of HBM's bandwidth.  So the keys are cut into splits,
and program (b, kv head, split) attends the queries of every query head of that KV head's group
(GQA: H / H_kv heads x S_q queries, one block of rows, so each key is loaded once for all of them)
over its split, with the online softmax (fp32 running max and sum, fp32 accumulator; bf16/fp16
operands on the tensor cores, the probabilities rounded to the values' dtype for the second
product as flash attention does; fp32 operands in IEEE fp32).  It writes the split's normalised
output and log-sum-exp; `partial` then merges the splits by their LSEs in fp32 (a few KB).  A row
with no key attended in a split gives lse -inf and output 0 there, and overall when every split
is empty (the merge across ranks skips it, merge.merge_).

The result is `decode.local_partial`'s: (out, lse) in fp32, checked against it in the tests
(tests/attention/test_decode_attention.py, in Triton's interpreter; tests/gpu on the device).
The mask (bool: True attends; or additive float) is read through its broadcast strides, never
expanded in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per step
TARGET_PROGRAMS = 264  # about two programs per SM of an H100 / H200: splits fill the machine
MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _decode_split_kernel(q, k, v, mask, out, lse, s_loc, chunk, scale, sq, rep, h_kv,
                         sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                         smb, smh, smq, sms, sob, soh, soq, sos, slb, slh, slq,
                         HAS_MASK: tl.constexpr, BOOL_MASK: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (b * H_kv + kv head, split): rows i < rep * sq are query head kv * rep + i // sq,
    query i % sq; keys [split * chunk, min((split + 1) * chunk, s_loc)).  Strides in elements:
    q, k, v (B, H, S, D order), the mask (B, H, S_q, S), out (B, H, S_q, split; its last is 1)
    and lse (B, H, S_q; its split stride is 1); out and lse are fp32."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // h_kv
    hk = pid_bh % h_kv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < rep * sq
    head = hk * rep + rows // sq
    qi = rows % sq
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_off = b * sqb + head * sqh + qi * sqs
    qt = tl.load(q + q_off[:, None] + dq[None, :] * sqd, mask=row_ok[:, None] & (dq[None, :] < D), other=0.0)
    k_base = k + b * skb + hk * skh
    v_base = v + b * svb + hk * svh
    m_base = b * smb + head * smh + qi * smq
    start = split * chunk
    stop = tl.minimum(start + chunk, s_loc)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < stop
        kt = tl.load(k_base + cols[:, None] * sks + dq[None, :] * skd, mask=col_ok[:, None] & (dq[None, :] < D),
                     other=0.0)
        if IEEE:
            s = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        else:
            s = tl.dot(qt, tl.trans(kt)) * scale
        ok = row_ok[:, None] & col_ok[None, :]
        if HAS_MASK:
            m_ptr = mask + m_base[:, None] + cols[None, :] * sms
            if BOOL_MASK:
                ok = ok & (tl.load(m_ptr, mask=ok, other=0) != 0)
            else:
                s = s + tl.load(m_ptr, mask=ok, other=0.0).to(tl.float32)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked row so far: no NaN
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + cols[:, None] * svs + dv[None, :] * svd, mask=col_ok[:, None] & (dv[None, :] < DV),
                     other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    row_lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    o_off = b * sob + head * soh + qi * soq + split * sos
    tl.store(out + o_off[:, None] + dv[None, :], o, mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(lse + b * slb + head * slh + qi * slq + split, row_lse, mask=row_ok)


def refusal(q, k, v, mask) -> str | None:
    """Why the kernel cannot take this call of CUDA tensors (decode.local_partial then runs), or None."""
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: the kernel takes one of bf16, fp16, fp32"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"head dims {q.shape[-1]}, {v.shape[-1]} over {MAX_HEAD_DIM}"
    if mask is not None and mask.dim() > 4:
        return f"a {mask.dim()}-D mask"
    return None


def splits_for(batch_kv_heads: int, s_loc: int) -> int:
    """How many splits of the keys: enough programs for TARGET_PROGRAMS, each at least BLOCK_N keys."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, batch_kv_heads), triton.cdiv(s_loc, BLOCK_N)))


def partial(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q (B, H, S_q, D) against k (B, H_kv, S_loc, D), v (B, H_kv, S_loc, Dv) with the
    optional mask (broadcastable to (B, H, S_q, S_loc)), in fp32: decode.local_partial's result."""
    bsz, heads, sq, d = q.shape
    h_kv, s_loc, dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = heads // h_kv
    splits = splits_for(bsz * h_kv, s_loc)
    chunk = triton.cdiv(triton.cdiv(s_loc, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(s_loc, chunk) if s_loc else 1
    parts = torch.empty(bsz, heads, sq, splits, dv, dtype=torch.float32, device=q.device)
    lses = torch.empty(bsz, heads, sq, splits, dtype=torch.float32, device=q.device)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).expand(bsz, heads, sq, s_loc)
    m_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    _decode_split_kernel[(bsz * h_kv, splits)](
        q, k, v, mask if mask is not None else q, parts, lses, s_loc, chunk, scale, sq, rep, h_kv,
        *q.stride(), *k.stride(), *v.stride(), *m_strides, *parts.stride()[:4], *lses.stride()[:3],
        HAS_MASK=mask is not None, BOOL_MASK=mask is not None and mask.dtype == torch.bool,
        IEEE=q.dtype == torch.float32, BLOCK_M=max(16, triton.next_power_of_2(rep * sq)),
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)), D=d, DV=dv,
        BLOCK_N=BLOCK_N, num_warps=4)
    return _merge_splits(parts, lses)


def _merge_splits(parts: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' outputs weighted by exp(lse_s - lse), lse their log-sum-exp (fp32); rows with
    every split empty: output 0, lse -inf."""
    lse = torch.logsumexp(lses, dim=-1)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - safe.unsqueeze(-1))  # empty splits: exp(-inf) = 0
    return (parts * weights.unsqueeze(-1)).sum(dim=-2), lse
