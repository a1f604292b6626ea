"""Per-rank program for the distributed decoding attention's reference (kernels/attention/decode.py):
every rank builds the whole cache from seeds, keeps its share, and compares with plain attention
over the whole cache in float64."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch_commopt.kernels.attention.decode import decode_attention_reference


def _full(q, k, v, mask):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


def run_decode(rank: int, world: int) -> list[tuple[str, float, list]]:
    """[(case, largest error vs whole-cache attention, this rank's result as a list)]."""
    group = dist.group.WORLD
    s_loc, results = 5, []
    for s_q in (1, 3):
        for kind in ("none", "prefix", "additive"):
            g = torch.Generator().manual_seed(10 * s_q + len(kind))
            q = torch.randn(2, 4, s_q, 16, generator=g, dtype=torch.float64)
            k = torch.randn(2, 2, world * s_loc, 16, generator=g, dtype=torch.float64)  # GQA: 2 KV heads
            v = torch.randn(2, 2, world * s_loc, 8, generator=g, dtype=torch.float64)
            if kind == "none":
                mask = None
            elif kind == "prefix":  # row i of batch b sees the first L keys: the later ranks' shares fully masked
                lengths = torch.tensor([[2, s_loc + 1, world * s_loc][: s_q]] * 2)
                mask = torch.arange(world * s_loc).view(1, 1, 1, -1) < lengths.view(2, 1, s_q, 1)
            else:
                mask = torch.randn(2, 1, s_q, world * s_loc, generator=g, dtype=torch.float64)
            want = _full(q, k, v, mask)
            share = slice(rank * s_loc, (rank + 1) * s_loc)
            mine = None if mask is None else mask[..., share]
            got = decode_attention_reference(q, k[:, :, share], v[:, :, share], mine, None, group)
            err = ((got - want).abs().max() / want.abs().max()).item()
            results.append((f"s_q {s_q} mask {kind}", err, got.flatten().tolist()))
    return results
