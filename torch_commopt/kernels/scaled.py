"""fp8 products: what `torch._scaled_mm` takes beside A and B, carried through the ops.

A region whose matmuls are `aten._scaled_mm` (hand-written float8 TP; the graphs torchao's
float8 training produces have not been tried) runs the same schedules as a bf16 one: every piece of rows is multiplied by
`_scaled_mm` instead of `mm`.  That holds for tensor-wise scales (one fp32 number for A and
one per B): a piece of A rows keeps A's scale, so out = (A_rows @ B) * s_a * s_b (+ bias) is
the piece's rows of the whole product.  Row-wise scales (one per row of A, one per column
of B) would have to travel with the rows they scale; the finders leave those regions
untouched, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
            if hasattr(torch, n))


@dataclass(frozen=True)
class Scaled:
    """The tensor-wise scales of A and of each weight, the output dtype and fast accumulation."""

    a_scale: torch.Tensor
    b_scales: tuple[torch.Tensor, ...]
    out_dtype: torch.dtype
    fast_accum: bool

    def mm(self, rows: torch.Tensor, w: torch.Tensor, i: int, bias=None, out=None) -> torch.Tensor:
        """rows @ w (weight i) scaled, + bias, written into `out` when given."""
        kwargs = {"bias": bias, "out_dtype": self.out_dtype, "use_fast_accum": self.fast_accum}
        if out is not None:
            kwargs["out"] = out
        return torch._scaled_mm(rows, w, self.a_scale, self.b_scales[i], **kwargs)


def of(a: torch.Tensor, a_scale, b_scales, out_dtype, fast_accum: bool, n_weights: int) -> Scaled | None:
    """The op arguments as a Scaled (None: a plain matmul); ValueError naming what is wrong."""
    if a_scale is None:
        if b_scales or out_dtype is not None:
            raise ValueError("commopt: b_scales / out_dtype given without a_scale (an fp8 product needs all three)")
        return None
    b_scales = tuple(b_scales or ())
    if len(b_scales) != n_weights:
        raise ValueError(f"commopt: {len(b_scales)} b_scales for {n_weights} weights")
    if a.dtype not in FP8:
        raise ValueError(f"commopt: a_scale given for a {a.dtype} input (scaled products take float8 inputs)")
    if out_dtype is None or out_dtype in FP8:
        raise ValueError(f"commopt: scaled products need a bf16/fp16/fp32 out_dtype, got {out_dtype}")
    for name, s in [("a_scale", a_scale)] + [(f"b_scales[{i}]", s) for i, s in enumerate(b_scales)]:
        if s.numel() != 1:
            raise ValueError(f"commopt: {name} has {s.numel()} elements; only tensor-wise scales are supported")
    return Scaled(a_scale, b_scales, out_dtype, bool(fast_accum))


def wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as the collectives move it: float8 bytes as uint8 (gloo has no float8 type; the
    bytes are what an all-gather moves)."""
    return t.view(torch.uint8) if t.dtype in FP8 else t


def call_key(sc: Scaled | None) -> tuple[tuple, tuple]:
    """(tensors, scalars) a scaled call adds to its per-call graph's key (kernels/gpu/call_graphs.py):
    a replay reads the scales where they were at the capture."""
    return ((), ()) if sc is None else ((sc.a_scale, *sc.b_scales), (sc.out_dtype, sc.fast_accum))


def out_dtype(a: torch.Tensor, scaled: Scaled | None) -> torch.dtype:
    return a.dtype if scaled is None else scaled.out_dtype


def matmul(rows: torch.Tensor, w: torch.Tensor, bias, scaled: Scaled | None = None, i: int = 0,
           out=None) -> torch.Tensor:
    """rows (M, K) @ w (K, N) (+ bias): mm / addmm, or the scaled product of weight i.
    rows may also be (B, M, K) blocks of rows, strided between blocks (whole outer blocks of a
    3-D activation), with out (B, M, N) as strided: one batched GEMM reads and writes them in
    place, where a matrix of them would cost a copy (not for scaled products: 2-D only); w
    may then come expanded to the batch already (a caller's, shared by its pieces)."""
    if rows.dim() == 3:
        if scaled is not None:
            raise ValueError("commopt: a scaled (float8) product of row blocks (torch._scaled_mm is 2-D only)")
        # batch stride 0: cuBLAS reads the one weight (w may come expanded already)
        wb = w if w.dim() == 3 else w.expand(rows.shape[0], *w.shape)
        kwargs = {} if out is None else {"out": out}
        return torch.bmm(rows, wb, **kwargs) if bias is None else torch.baddbmm(bias, rows, wb, **kwargs)
    if scaled is not None:
        return scaled.mm(rows, w, i, bias, out)
    if out is None:
        return torch.mm(rows, w) if bias is None else torch.addmm(bias, rows, w)
    return torch.mm(rows, w, out=out) if bias is None else torch.addmm(bias, rows, w, out=out)


class Expanded:
    """Weights expanded to a batch of n row blocks (batch stride 0, what `matmul` and
    `add_matmul_` take for (n, M, K) rows), made once per n in a call rather than once per
    piece and weight: each expand is a dispatch of a region call's host time."""

    def __init__(self, weights):
        self.weights, self.by_blocks = list(weights), {}

    def __call__(self, blocks: int) -> list[torch.Tensor]:
        got = self.by_blocks.get(blocks)
        if got is None:
            got = self.by_blocks[blocks] = [w.expand(blocks, *w.shape) for w in self.weights]
        return got


def add_matmul_(out: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, *, beta: float = 1.0,
                alpha: float = 1.0) -> torch.Tensor:
    """out <- beta * out + alpha * rows @ w in place (addmm_; baddbmm_ for (B, M, K) row
    blocks into (B, M, N), as `matmul`, w expanded to the batch or not)."""
    if rows.dim() == 3:
        return out.baddbmm_(rows, w if w.dim() == 3 else w.expand(rows.shape[0], *w.shape), beta=beta, alpha=alpha)
    return out.addmm_(rows, w, beta=beta, alpha=alpha)
