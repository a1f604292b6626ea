"""Host-side checks and tensor descriptors for the TMA kernels (ag_gemm_tma_kernel,
rs_gemm_kernel with TMA=True): where the TMA unit cannot take an operand, pointer loads run
(logged once per op and reason)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch

log = logging.getLogger(__name__)
SMEM_SLACK = 4096  # shared memory a kernel needs beside its tiles (barriers, reductions), in bytes
_logged: set[tuple[str, str]] = set()


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


def _boxes(a_operands, bs, kmajor: bool, bm: int, bn: int, bk: int):
    a_block, b_block = [bm, bk], ([bn, bk] if kmajor else [bk, bn])
    return [(a, a_block) for a in a_operands] + [(b, b_block) for b in bs]


def refusal(a_operands: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], bm: int, bn: int,
            bk: int) -> Optional[str]:
    """Why the TMA kernels cannot take these operands (None: they can)."""
    views = b_views(weights)
    if views is None:
        return "the weights are neither all K-major nor all row-major"
    bs, kmajor = views
    if not all(aligned(t) for t in [*a_operands, *bs]):
        return "a base or row pitch is not 16-byte aligned"
    if any(d < blk for t, block in _boxes(a_operands, bs, kmajor, bm, bn, bk) for d, blk in zip(t.shape, block)):
        return "a tensor is smaller than one tile"
    return None


def descriptors(op: str, a_operands: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], bm: int, bn: int,
                bk: int, why_not: Optional[str] = None):
    """(A descriptors [bm, bk], B descriptors, B K-major) for the TMA kernels, or None where
    TMA cannot take the operands (`refusal`, or the caller's own `why_not`): then the
    pointer-load kernel runs, which is logged once per op and reason."""
    why = why_not or refusal(a_operands, weights, bm, bn, bk)
    if why is not None:
        if (op, why) not in _logged:
            _logged.add((op, why))
            log.info("commopt %s fused tma=1: %s; this call runs the pointer-load kernel", op, why)
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    bs, kmajor = b_views(weights)
    boxes = _boxes(a_operands, bs, kmajor, bm, bn, bk)
    descs = [TensorDescriptor.from_tensor(t, block) for t, block in boxes]
    return descs[:len(a_operands)], descs[len(a_operands):], kmajor


def out_descriptors(outs: Sequence[torch.Tensor], lin: int, params: dict) -> Optional[list]:
    """Descriptors [bm, bn] of a fused all-gather's outputs (2-D, full rows) for the TMA store,
    or None where a tile's rows would not be one run of an output (lin not a multiple of bm:
    the tile would cross into another rank's rows), an output is not aligned, or the tile's
    staging buffer would not fit in shared memory beside the mainloop's stages: then the
    kernel stores by pointers."""
    bm, bn, bk, stages = params["bm"], params["bn"], params["bk"], params["stages"]
    if lin % bm or not all(o.dim() == 2 and o.stride(1) == 1 and aligned(o) for o in outs):
        return None
    elt = outs[0].element_size()
    need = (stages * (bm + bn) * bk + bm * bn) * elt + SMEM_SLACK
    if need > torch.cuda.get_device_properties(outs[0].device).shared_memory_per_block_optin:
        return None
    if any(d < blk for o in outs for d, blk in zip(o.shape, (bm, bn))):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return [TensorDescriptor.from_tensor(o, [bm, bn]) for o in outs]


def flat_ok(params: dict, k: int) -> bool:
    """Whether the fused all-gather TMA kernel runs its tile and k loops as one pipelined loop
    (flat=1): only where a tile has at least twice as many k steps as the pipeline has stages.
    The kernel awaits a tile's flag at the start of the tile before it
    (triton_kernels._tma_sweep); the pipeline issues a step's loads up to stages - 1 steps
    early, and may run that start's wait up to stages - 1 steps late, so the wait stays ahead
    of the loads it guards while a tile has more than 2 (stages - 1) k steps."""
    return bool(params.get("flat")) and -(-k // params["bk"]) >= 2 * params["stages"]
