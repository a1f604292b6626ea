"""Small tensor-parallel models used by the demo and the tests.

`LlamaBlock`: RMSNorm -> attention (q/k/v/o) -> residual -> RMSNorm -> SwiGLU MLP ->
residual, with `tp_sp_plan` the torchtitan-style TP+SP plan (norms sequence-parallel,
q/k/v and w1/w3 column-parallel behind one all-gather, o and w2 row-parallel into a
reduce-scatter).  `FuncolMLP`: the same MLP written with functional collectives.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    """Causal self-attention; n_kv_heads < n_heads is GQA (Llama-3: 32 / 8)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None):
        super().__init__()
        self.head_dim = dim // n_heads
        kv = (n_kv_heads or n_heads) * self.head_dim
        self.gqa = kv != dim
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv, bias=False)
        self.wv = nn.Linear(dim, kv, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / W of them.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int = 64, n_heads: int = 4, hidden: int = 128, n_kv_heads: int | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class MLPBlock(nn.Module):
    """RMSNorm + SwiGLU MLP with a residual: the TP+SP MLP of the tests."""

    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.ffn_norm(x))


def tp_sp_plan(model: nn.Module) -> dict:
    """torchtitan's TP+SP plan for whichever of attention / feed_forward the model has."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {}
    if hasattr(model, "attention"):
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        })
    plan.update({
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    })
    return plan


def tp_plan(model: nn.Module) -> dict:
    """Tensor parallelism without sequence parallelism (Megatron): the block's input and
    residual stream replicated, q/k/v and w1/w3 column-parallel, o and w2 row-parallel into
    an all-reduce."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    if hasattr(model, "attention"):
        plan.update({"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                     "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
    plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                 "feed_forward.w3": ColwiseParallel()})
    return plan


class FuncolMLP(nn.Module):
    """Hand-written SP MLP: all-gather rows (dim 0) -> x @ w1 -> gelu -> @ w2 -> reduce-scatter rows.

    w1: (dim, hidden / W) column shard; w2: (hidden / W, dim) row shard; input (rows / W, dim)."""

    def __init__(self, dim: int, hidden_local: int, group_name: str):
        super().__init__()
        self.group_name = group_name
        self.w1 = nn.Parameter(torch.randn(dim, hidden_local) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(hidden_local, dim) / hidden_local**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=self.group_name)
        partial = F.gelu(full @ self.w1) @ self.w2
        return funcol.reduce_scatter_tensor_autograd(partial, "sum", scatter_dim=0, group=self.group_name)


class CapacityMoE(nn.Module):
    """A fixed-capacity MoE layer (GShard / Switch style) over `world` ranks: top-1 routing, each
    expert takes at most `capacity` tokens a rank (the rest dropped), the tokens laid out
    [experts, capacity, dim] and exchanged by all_to_all_single on equal splits, the local
    experts a SwiGLU as batched GEMMs over [local experts, ranks x capacity, dim], the outputs
    exchanged back and combined with the gate.  What torch.compile sees whole."""

    def __init__(self, dim: int, hidden: int, experts: int, world: int, capacity: int, group_name: str):
        super().__init__()
        self.world, self.local, self.capacity, self.group_name = world, experts // world, capacity, group_name
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(self.local, dim, hidden) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(self.local, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(self.local, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        experts, cap = self.world * self.local, self.capacity
        gate, idx = self.router(x).softmax(-1).max(-1)
        onehot = F.one_hot(idx, experts)  # integers: a bf16 count is inexact past 256
        pos = (onehot.cumsum(0) - 1) * onehot  # each token's place in its expert's queue
        keep = ((pos < cap) * onehot).to(x.dtype)
        slot = F.one_hot(pos.clamp(max=cap - 1), cap).to(x.dtype) * keep.unsqueeze(-1)  # (T, E, C)
        sent = torch.einsum("tec,td->ecd", slot, x).reshape(experts * cap, dim)
        got = funcol.all_to_all_single_autograd(sent, None, None, self.group_name)
        h = got.view(self.world, self.local, cap, dim).transpose(0, 1).reshape(self.local, self.world * cap, dim)
        y = torch.bmm(F.silu(torch.bmm(h, self.w1)) * torch.bmm(h, self.w3), self.w2)
        y = y.view(self.local, self.world, cap, dim).transpose(0, 1).reshape(experts * cap, dim)
        back = funcol.all_to_all_single_autograd(y, None, None, self.group_name).view(experts, cap, dim)
        return torch.einsum("tec,ecd->td", slot * gate[:, None, None], back)
