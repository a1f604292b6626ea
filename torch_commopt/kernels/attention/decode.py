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
[out | lse], the merge.  `decode_attention` is what the op runs: on CUDA the local attention is
the split-KV Triton kernel (decode_triton.py: the cache read once in its own dtype, fp32
softmax and accumulators), checked against the reference's, and the same gather and merge.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels.attention.merge import merge_
from torch_commopt.kernels.collectives import all_gather

log = logging.getLogger("torch_commopt.kernels.attention.decode")


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
    return _gather_and_merge(out, lse, q.dtype, group)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
                     group: dist.ProcessGroup) -> Tensor:
    """decode_attention_reference's result, its local attention by the split-KV Triton kernel on
    CUDA (decode_triton.partial) where that takes the call, else the reference's."""
    if q.device.type != "cuda":
        return decode_attention_reference(q, k, v, mask, scale, group)
    from torch_commopt.kernels.attention import decode_triton

    why = decode_triton.refusal(q, k, v, mask)
    if why is not None:
        if why not in _told:
            _told.add(why)
            log.info("commopt decode attention: the reference's local attention runs (%s)", why)
        return decode_attention_reference(q, k, v, mask, scale, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = decode_triton.partial(q, k, v, mask, scale)
    if _low_latency(out, group):
        return _gather_and_merge_ll(out, lse, q.dtype, group)
    return _gather_and_merge(out, lse, q.dtype, group)


_told: set[str] = set()


def _tell(why: str) -> None:
    if why not in _told:
        _told.add(why)
        log.info("commopt decode attention: %s", why)


def _low_latency(out: Tensor, group: dist.ProcessGroup) -> bool:
    """Whether the partials travel by the low-latency all-gather (TORCH_COMMOPT_DECODE_TRANSPORT):
    asked, every rank able to map its peers' memory (one vote per group), the packed partials
    within the buffer, and under a capture the buffer already made.  Every input to it is the
    same on every rank (shapes, the vote, the buffer, made collectively), so all decide alike;
    each other answer is logged once."""
    from torch_commopt.core import env
    from torch_commopt.kernels.gpu import lowlat, peers, symm
    from torch_commopt.kernels.gpu.call_graphs import capturing

    want = env.decode_transport()
    if want != "ll":
        if want != "nccl":
            _tell(f"{env.DECODE_TRANSPORT}={want!r} is not ll or nccl: NCCL gathers the partials")
        return False
    if group.size() > symm.MAX_WORLD:
        _tell(f"{group.size()} ranks, over {symm.MAX_WORLD}: NCCL gathers the partials")
        return False
    if not lowlat.LowLatency.fits(out.numel() // out.shape[-1] * (out.shape[-1] + 1), torch.float32):
        _tell(f"partials of {tuple(out.shape)} exceed the low-latency buffer: NCCL gathers them")
        return False
    if capturing():
        rt = symm.existing(group.group_name, out.device)
        if rt is None or not rt.has_own_buffer(lowlat.PURPOSE, lowlat.LL_CAP_BYTES):
            _tell("captured before the low-latency buffer exists (run a call outside the graph first): "
                  "NCCL gathers the partials")
            return False
        return True
    ok, why = peers.agreed(group, out.device)
    if not ok:
        _tell(f"the group {why}: NCCL gathers the partials")
    return ok


def _gather_and_merge_ll(out: Tensor, lse: Tensor, dtype: torch.dtype, group: dist.ProcessGroup) -> Tensor:
    """_gather_and_merge with the low-latency all-gather: [out | lse] packed into this rank's slot,
    every slot read into one (W, ...) tensor, merged in rank order."""
    from torch_commopt.kernels.gpu import lowlat, symm

    ll = lowlat.for_runtime(symm.runtime(group.group_name, out.device))
    shape = tuple(out.shape[:-1]) + (out.shape[-1] + 1,)
    slot = ll.slot(shape, torch.float32)
    slot[..., :-1].copy_(out)
    slot[..., -1].copy_(lse)
    gathered = torch.empty((group.size(),) + shape, dtype=torch.float32, device=out.device)
    ll.all_gather(gathered, debug=symm.debug_waits())
    return _merge_gathered(gathered, dtype)


def _gather_and_merge(out: Tensor, lse: Tensor, dtype: torch.dtype, group: dist.ProcessGroup) -> Tensor:
    """Every rank's (out, lse) gathered (one all-gather of [out | lse]) and merged in rank order, in
    fp32; the result in `dtype`."""
    packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1).contiguous()  # (B, H, S_q, Dv + 1)
    gathered = all_gather(packed.unsqueeze(0), 0, group, async_op=False).wait()  # (W, B, H, S_q, Dv + 1)
    return _merge_gathered(gathered, dtype)


def _merge_gathered(gathered: Tensor, dtype: torch.dtype) -> Tensor:
    """Every rank's [out | lse] (W, ..., Dv + 1) merged in rank order in fp32; the result in `dtype`."""
    world = gathered.shape[0]
    acc_out, acc_lse = gathered[0, ..., :-1].clone(), gathered[0, ..., -1].clone()
    for r in range(1, world):
        merge_(acc_out, acc_lse, gathered[r, ..., :-1], gathered[r, ..., -1].contiguous())
    return acc_out.to(dtype)
