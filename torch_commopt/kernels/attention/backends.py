"""The registry of block-attention implementations (local.py picks among them; fused.py
adds the CUDA kernels when it is imported)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from torch import Tensor


@dataclass(frozen=True)
class LocalBackend:
    """One implementation of block attention.

    fwd(q, k, v, scale, causal) -> (out (B, H, S_q, D) any float dtype, lse (B, H, S_q) acc dtype)
    bwd(dout, q, k, v, out, lse, scale, causal) -> (dq, dk, dv) in the acc dtype or q's; dk, dv
        have k's H_kv heads (the kernel's own group sums, or expanded heads folded in the acc dtype).
    why_not(q, k) -> None when the backend can take these operands, else the reason.
    auto: whether backend="auto" may pick it.
    """

    name: str
    fwd: Callable[..., tuple[Tensor, Tensor]]
    bwd: Callable[..., tuple[Tensor, Tensor, Tensor]]
    why_not: Callable[[Tensor, Tensor], Optional[str]]
    auto: bool = True


REGISTRY: dict[str, LocalBackend] = {}


def register(backend: LocalBackend) -> LocalBackend:
    REGISTRY[backend.name] = backend
    return backend


def backends() -> dict[str, LocalBackend]:
    """The registered backends (the CUDA ones appear once fused.py is imported)."""
    return dict(REGISTRY)
