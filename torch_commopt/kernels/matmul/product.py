"""The product a matmul + reduction op reduces, as one value its schedules pass whole."""

from __future__ import annotations

from typing import NamedTuple

import torch

from torch_commopt.kernels.scaled import Scaled


class Product(NamedTuple):
    """t = a @ weight (+ bias) + sum_i a_i @ w_i over `parts`, the K parts ((a_i, w_i), ...;
    ops.k_parts); sc: the products are torch._scaled_mm's (kernels/scaled.py; None: plain).
    a: (*, K); weight: (K, N); bias: (N,) or None.  Built once per op call: a NamedTuple,
    whose construction costs the host path a fraction of a frozen dataclass's."""

    a: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    sc: Scaled | None = None
    parts: tuple = ()

    def part_tensors(self) -> tuple:
        """The K parts' tensors, flat (a_1, w_1, a_2, w_2, ...)."""
        return tuple(t for pair in self.parts for t in pair)
