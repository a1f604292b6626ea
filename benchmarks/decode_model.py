"""The decoder bench_decode --step times (benchmarks/decode_step.py): a Llama-3-style decoder step
(RMSNorm, RoPE, GQA attention against a KV cache, SwiGLU), tensor-parallel over `TP`'s ranks with
an all-reduce after each row-parallel projection, its weights and cache drawn from seeded random
values so that every rank's shard is a slice of the unsharded model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SEED = 1234


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The decoder's dimensions (Llama-3-8B's by default)."""

    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    norm_eps: float = 1e-5
    rope_base: float = 500000.0


LLAMA3_8B = Shape()
TINY = Shape(dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=128)


@dataclass(frozen=True, kw_only=True)
class Case:
    """One measured point: batch rows decoding against a cache of `ctx` positions."""

    batch: int
    ctx: int


def _upcast(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`t` in x's dtype: a no-op in the model's own dtype; the higher-precision run reads the
    same stored weights and cache upcast."""
    return t.to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in at least float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * _upcast(self.weight, x)


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, 1, h, head_dim] at one position (freqs [1, head_dim / 2, 2]: cos, sin)."""
    xs = x.reshape(*x.shape[:-1], -1, 2)
    f = _upcast(freqs, x).view(1, 1, 1, xs.shape[-2], 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3)


class TP:
    """Where a module sits in the tensor-parallel split: this rank of `world`, and the group
    its row-parallel outputs are all-reduced over (None at world 1)."""

    def __init__(self, rank: int, world: int, group=None) -> None:
        self.rank, self.world, self.group = rank, world, group

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """y summed over the group (torch's functional all-reduce); y itself at world 1."""
        if self.world == 1:
            return y
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(y, "sum", self.group)


class Attention(nn.Module):
    """This rank's query and KV heads: wqkv column-parallel, the cache of its KV heads, wo
    row-parallel into the all-reduce."""

    def __init__(self, shape: Shape, tp: TP, case: Case, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp, self.hd = tp, shape.head_dim
        self.heads, self.kv = shape.heads // tp.world, shape.kv_heads // tp.world
        self.wqkv = nn.Parameter(torch.empty((self.heads + 2 * self.kv) * self.hd, shape.dim, dtype=dtype))
        self.wo = nn.Parameter(torch.empty(shape.dim, self.heads * self.hd, dtype=dtype))
        cache = (case.batch, self.kv, case.ctx, self.hd)
        self.register_buffer("k_cache", torch.zeros(cache, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor):
        """x [B, 1, dim], freqs [1, head_dim / 2, 2], mask [1, 1, 1, ctx] (bool), input_pos [1]
        -> [B, 1, dim], summed over the ranks; the new K and V written into the cache at input_pos."""
        b, hd = x.shape[0], self.hd
        q, k, v = F.linear(x, _upcast(self.wqkv, x)).split([self.heads * hd, self.kv * hd, self.kv * hd], -1)
        q = _rope(q.view(b, 1, self.heads, hd), freqs)
        k = _rope(k.view(b, 1, self.kv, hd), freqs).transpose(1, 2)
        self.k_cache[:, :, input_pos] = k.to(self.k_cache.dtype)
        self.v_cache[:, :, input_pos] = v.view(b, 1, self.kv, hd).transpose(1, 2).to(self.v_cache.dtype)
        # the query heads of one KV head are consecutive: [B, kv, heads / kv, hd] reads each cache once
        grouped = q.reshape(b, self.kv, self.heads // self.kv, hd)
        y = F.scaled_dot_product_attention(grouped, _upcast(self.k_cache, x), _upcast(self.v_cache, x),
                                           attn_mask=mask)
        return self.tp.reduce(F.linear(y.reshape(b, 1, self.heads * hd), _upcast(self.wo, x)))


class FeedForward(nn.Module):
    """SwiGLU: w1/w3 column-parallel, w2 row-parallel into the all-reduce."""

    def __init__(self, shape: Shape, tp: TP, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp, local = tp, shape.ffn // tp.world
        self.w1 = nn.Parameter(torch.empty(local, shape.dim, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(local, shape.dim, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(shape.dim, local, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.linear(x, _upcast(self.w1, x))) * F.linear(x, _upcast(self.w3, x))
        return self.tp.reduce(F.linear(h, _upcast(self.w2, x)))


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual stream."""

    def __init__(self, shape: Shape, tp: TP, case: Case, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps, dtype)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps, dtype)
        self.attention = Attention(shape, tp, case, dtype)
        self.feed_forward = FeedForward(shape, tp, dtype)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor):
        h = x + self.attention(self.attention_norm(x), freqs, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """The decoder split over tp.world ranks; forward(tokens [B, 1], input_pos [1]) -> logits [B, 1, vocab]."""

    def __init__(self, shape: Shape, tp: TP, case: Case, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok_embeddings = nn.Parameter(torch.empty(shape.vocab, shape.dim, dtype=dtype))
        self.layers = nn.ModuleList(Block(shape, tp, case, dtype) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.dim, shape.norm_eps, dtype)
        self.output = nn.Parameter(torch.empty(shape.vocab, shape.dim, dtype=dtype))
        self.register_buffer("freqs", _rope_table(shape, case.ctx), persistent=False)
        self.register_buffer("positions", torch.arange(case.ctx), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.decode(F.embedding(tokens, self.tok_embeddings), input_pos)

    def decode(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """The step from the embedded tokens x [B, 1, dim], in x's dtype."""
        freqs = self.freqs[input_pos]
        mask = (self.positions <= input_pos).view(1, 1, 1, -1)
        for layer in self.layers:
            x = layer(x, freqs, mask, input_pos)
        return F.linear(self.norm(x), _upcast(self.output, x))


def _rope_table(shape: Shape, ctx: int) -> torch.Tensor:
    """[ctx, head_dim / 2, 2] (cos, sin), float32."""
    inv = 1.0 / shape.rope_base ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
    angles = torch.outer(torch.arange(ctx).float(), inv)
    return torch.stack([angles.cos(), angles.sin()], -1)


# ---------------------------------------------------------------- weights: slices of one full set


def _randn(shape: tuple, seed: int, device, scale: float) -> torch.Tensor:
    """N(0, scale^2) float32 values of `shape` from their own seed (the same on every rank)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale


def full_layer(shape: Shape, layer: int, device) -> dict[str, torch.Tensor]:
    """The unsharded weights of one layer, float32, the same on every rank: wq, wk, wv, wo, w1, w3, w2
    in nn.Linear's [out, in] layout, each N(0, 1 / in)."""
    d, hd, f = shape.dim, shape.head_dim, shape.ffn
    sizes = {"wq": (shape.heads * hd, d), "wk": (shape.kv_heads * hd, d), "wv": (shape.kv_heads * hd, d),
             "wo": (d, shape.heads * hd), "w1": (f, d), "w3": (f, d), "w2": (d, f)}
    return {name: _randn(size, SEED + 100 * layer + i, device, size[1] ** -0.5)
            for i, (name, size) in enumerate(sizes.items())}


def shard_layer(full: dict[str, torch.Tensor], shape: Shape, tp: TP) -> dict[str, torch.Tensor]:
    """This rank's slices of a layer (full_layer): its query and KV heads' rows of wq/wk/wv (as one
    wqkv), their columns of wo, its rows of w1/w3 and columns of w2."""
    r, w = tp.rank, tp.world

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(w, 0)[r]

    return {"wqkv": torch.cat([rows(full["wq"]), rows(full["wk"]), rows(full["wv"])]),
            "wo": full["wo"].chunk(w, 1)[r], "w1": rows(full["w1"]), "w3": rows(full["w3"]),
            "w2": full["w2"].chunk(w, 1)[r]}


def _fill_cache(cache: torch.Tensor, layer: int, which: int, tp: TP) -> None:
    """This rank's KV heads of a layer's cache: each head's [B, ctx, head_dim] drawn from its own
    seed, so every split holds slices of the unsharded cache."""
    heads = cache.shape[1]
    for j in range(heads):
        head = tp.rank * heads + j
        cache[:, j] = _randn(cache[:, j].shape, SEED + 10**6 + 1000 * layer + 100 * which + head, cache.device,
                             1.0).to(cache.dtype)


@torch.no_grad()
def build(shape: Shape, tp: TP, case: Case, device, dtype: torch.dtype) -> Decoder:
    """The decoder for this rank, its weights and cache filled (slices of the full set)."""
    with torch.device(device):
        model = Decoder(shape, tp, case, dtype)
    model.tok_embeddings.copy_(_randn(model.tok_embeddings.shape, SEED - 1, device, 1.0))
    model.output.copy_(_randn(model.output.shape, SEED - 2, device, shape.dim ** -0.5))
    for i, layer in enumerate(model.layers):
        mine = shard_layer(full_layer(shape, i, device), shape, tp)
        for name in ("wqkv", "wo"):
            getattr(layer.attention, name).copy_(mine[name])
        for name in ("w1", "w3", "w2"):
            getattr(layer.feed_forward, name).copy_(mine[name])
        _fill_cache(layer.attention.k_cache, i, 0, tp)
        _fill_cache(layer.attention.v_cache, i, 1, tp)
    return model


def step_bytes(shape: Shape, case: Case, world: int, itemsize: int) -> int:
    """The bytes one rank must read per step: its weights (the whole output head, the B embedding
    rows looked up) and its KV heads' cache over the context."""
    d, hd = shape.dim, shape.head_dim
    per_layer = ((shape.heads + 2 * shape.kv_heads) * hd * d + d * shape.heads * hd + 3 * shape.ffn * d) // world
    per_layer += 2 * d  # the two norms
    weights = shape.layers * per_layer + shape.vocab * d + d + case.batch * d  # + the final norm, the rows looked up
    cache = shape.layers * 2 * case.batch * (shape.kv_heads // world) * case.ctx * hd
    return (weights + cache) * itemsize
