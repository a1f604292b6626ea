"""FlexAttention's block forward and backward in plain torch on a dense mask: what flex.py's
block_forward / block_backward run off CUDA.

Off CUDA the block runs in plain torch on its dense mask, not by flex's operators: their dense
math vmaps the mask function, and vmap fails where a compiled graph's op runs ("NYI: querying
is_contiguous inside of vmap"); the flex kernels' block tables are checked on the GPU
(tests/gpu, benchmarks/probe_flex_blocks.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of q against k, v under the boolean `mask` (rows with no key: output 0, lse -inf)."""
    from torch_commopt.kernels.attention.decode import local_partial

    return local_partial(q, k, v, mask, scale)


def backward(q: Tensor, k: Tensor, v: Tensor, rows: tuple[Tensor, Tensor, Tensor], mask: Tensor,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward of one block from its rows' global (out, lse, dout): P = exp(S - lse)."""
    out, lse, dout = rows
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    kf, vf = (t.to(acc).repeat_interleave(rep, dim=1) for t in (k, v))
    qf, dof = q.to(acc), dout.to(acc)
    scores = (qf @ kf.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).to(acc).unsqueeze(-1))
    dv = probs.transpose(-1, -2) @ dof
    ds = probs * (dof @ vf.transpose(-1, -2) - (dof * out.to(acc)).sum(-1, keepdim=True))
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale
    fold = lambda g: g.unflatten(1, (k.shape[1], rep)).sum(2)  # noqa: E731  (GQA: a KV head's group summed)
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)
