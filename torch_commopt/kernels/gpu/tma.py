"""Host-side checks and tensor descriptors for the TMA kernels (ag_gemm_tma_kernel,
rs_gemm_kernel with TMA=True): where the TMA unit cannot take an operand, pointer loads run."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def aligned(t: torch.Tensor) -> bool:
    """Base and every row pitch 16-byte aligned (what a tensor descriptor requires)."""
    return t.data_ptr() % 16 == 0 and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1])


def b_views(weights: Sequence[torch.Tensor]) -> Optional[tuple[list[torch.Tensor], bool]]:
    """The B operands (K, N) as contiguous-last-dim views and whether they are K-major (B^T
    (N, K), nn.Linear's weight transposed), or None if they mix layouts or neither fits."""
    if all(w.stride(0) == 1 for w in weights):
        return [w.t() for w in weights], True
    if all(w.stride(1) == 1 for w in weights):
        return list(weights), False
    return None


def descriptors(a_operands: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], bm: int, bn: int, bk: int):
    """(A descriptors [bm, bk], B descriptors, B K-major) for the TMA kernels, or None where
    TMA cannot take the operands: a row pitch or base not 16-byte aligned, B's of mixed
    layouts, or a tensor smaller than its box (the pointer kernel's masks take those)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    views = b_views(weights)
    if views is None:
        return None
    bs, kmajor = views
    if not all(aligned(t) for t in [*a_operands, *bs]):
        return None
    a_block, b_block = [bm, bk], ([bn, bk] if kmajor else [bk, bn])
    boxes = [(a, a_block) for a in a_operands] + [(b, b_block) for b in bs]
    if any(d < blk for t, block in boxes for d, blk in zip(t.shape, block)):
        return None
    return ([TensorDescriptor.from_tensor(a, a_block) for a in a_operands],
            [TensorDescriptor.from_tensor(b, b_block) for b in bs], kmajor)
