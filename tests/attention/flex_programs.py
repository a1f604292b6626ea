"""Per-rank programs for FlexAttention over a sequence-sharded ring (kernels/attention/flex_ring.py):
every rank builds the whole sequence's inputs and mask from seeds and checks its shares of the
output and gradients against dense attention over the whole sequence in float64."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

S, BLOCK, D = 1024, 128, 16


def doc_ids(batch: int) -> torch.Tensor:
    """Per batch row, document ids over S tokens: documents that cross shares, a one-token one, one
    longer than a share at 4 ranks (301..700), and another layout for the second row."""
    ids = torch.zeros(batch, S, dtype=torch.int32)
    for b, cuts in enumerate([(100, 300, 301, 700), (50, 600, 601, 900)][:batch]):
        for cut in cuts:
            ids[b, cut:] += 1
    return ids


def mask_mod_of(kind: str, docs: torch.Tensor, window: int = 200):
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    if kind == "causal":
        return causal
    if kind == "document":
        return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv)
    if kind == "window":
        return lambda b, h, q, kv: (q >= kv) & (q - kv < window)
    if kind == "document+window":
        return lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (q >= kv) & (q - kv < window)
    raise ValueError(kind)


def _dense(q, k, v, dense_mask, scale):
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ kr.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~dense_mask, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row with no key: 0
    return probs @ vr


def run_flex_ring(rank: int, world: int, kind: str, batch: int = 1, heads: int = 4, kv_heads: int = 2) -> dict:
    """{"errors": {name: max abs error vs dense float64}, "work": the (W, W) tiles, "computed": the
    blocks this rank's forward computed}."""
    from torch.nn.attention.flex_attention import create_block_mask

    from torch_commopt.kernels.attention import flex, flex_ring

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(batch, heads, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    mod = mask_mod_of(kind, doc_ids(batch))
    block_mask = create_block_mask(mod, batch, None, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    scale = 1 / math.sqrt(D)
    length = S // world
    mine = slice(rank * length, (rank + 1) * length)
    computed = []
    forward = flex.block_forward

    def counted(*args):
        computed.append(1)
        return forward(*args)

    flex.block_forward = counted
    try:
        qs, ks, vs = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        out = flex_ring.flex_ring(qs, ks, vs, block_mask, scale, group)
        out.backward(dout[:, :, mine])
    finally:
        flex.block_forward = forward
    pos = torch.arange(S)
    dense_mask = torch.stack([mod(b, 0, pos[:, None], pos[None, :]) for b in range(batch)])[:, None]
    qt, kt, vt = (t.clone().requires_grad_() for t in (q, k, v))
    want = _dense(qt, kt, vt, dense_mask, scale)
    want.backward(dout)
    errors = {"out": (out - want[:, :, mine]).abs().max().item(),
              "dq": (qs.grad - qt.grad[:, :, mine]).abs().max().item(),
              "dk": (ks.grad - kt.grad[:, :, mine]).abs().max().item(),
              "dv": (vs.grad - vt.grad[:, :, mine]).abs().max().item()}
    return {"errors": errors, "work": flex.work(flex.Blocks.of(block_mask), world).tolist(), "computed": len(computed)}
