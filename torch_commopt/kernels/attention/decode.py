"""Distributed decoding attention: a few queries against a KV cache sharded along the sequence.

At decode time each rank holds its share of a long KV cache (rank r the keys [r * S_loc,
(r + 1) * S_loc)) and every rank has the same few queries (the new tokens).  Rather than gathering
the cache, each rank attends over its own share, keeping the log-sum-exp of its scores, and the
ranks exchange only their partial outputs and LSEs ((B, H, S_q, Dv + 1) per rank: a few KB), which
every rank merges in rank order 0..W-1 (merge.merge_, fp32): every rank gets the same result,
the attention over the whole cache (Triton-distributed's distributed flash-decoding; the merge is
ring attention's).

`decode_attention_reference` is the reference schedule, plain torch + c10d on any backend: the
local attention in fp32 (math, with GQA and an optional mask over this rank's keys; a rank whose
keys are all masked for a row gives that row lse = -inf, which the merge skips), one all-gather of
[out | lse], the merge.  The GPU forms (a split-KV Triton kernel, the low-latency all-gather) are
checked against it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels.attention.merge import merge_
from torch_commopt.kernels.collectives import all_gather


def local_partial(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of q against this rank's keys, in fp32 (float64 for a float64 run).

    q: (B, H, S_q, D); k: (B, H_kv, S_loc, D); v: (B, H_kv, S_loc, Dv), H_kv dividing H; mask:
    None, a bool tensor (True: the key is attended) or an additive float one, broadcastable to
    (B, H, S_q, S_loc).  A row with no key attended gets out 0 and lse -inf."""
    if q.dim() != 4 or k.dim() != 4 or v.shape[:3] != k.shape[:3] or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
                         "(B, H, S_q, D), (B, H_kv, S_loc, D), (B, H_kv, S_loc, Dv) with H_kv dividing H")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    kf = k.to(acc).repeat_interleave(rep, dim=1)
    vf = v.to(acc).repeat_interleave(rep, dim=1)
    scores = torch.matmul(q.to(acc), kf.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    out = torch.matmul(weights, vf)  # rows with lse -inf: every weight exp(-inf) = 0
    return out, lse


def decode_attention_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
                               group: dist.ProcessGroup) -> Tensor:
    """The attention of q (replicated) over the whole sequence-sharded cache, in q's dtype (see
    the module docstring); every rank returns the same tensor."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = local_partial(q, k, v, mask, scale)
    world = group.size()
    packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # (B, H, S_q, Dv + 1)
    gathered = all_gather(packed.unsqueeze(0), 0, group, async_op=False).wait()  # (W, B, H, S_q, Dv + 1)
    acc_out, acc_lse = gathered[0, ..., :-1].clone(), gathered[0, ..., -1].clone()
    for r in range(1, world):
        merge_(acc_out, acc_lse, gathered[r, ..., :-1], gathered[r, ..., -1].contiguous())
    return acc_out.to(q.dtype)
