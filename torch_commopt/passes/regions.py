"""What the finders report: regions (a compute op with the collective feeding or draining it)
and skipped candidates with their reasons.  Pure data; the rewrite reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.fx import Node

from torch_commopt.passes.graph_utils import is_static
from torch_commopt.reshard.layouts import Layout


@dataclass(frozen=True)
class ScaledArgs:
    """What a torch._scaled_mm matmul takes beside A, B and the bias (kernels/scaled.py):
    tensor-wise scales of A and B, the output dtype, fast accumulation."""

    a_scale: Node
    b_scale: Node
    out_dtype: Any
    fast_accum: bool


@dataclass
class Consumer:
    """A matmul fed by an all-gather: `path` is the row-preserving chain from the gathered
    tensor to the matmul's A operand.  scaled: the matmul is a float8 torch._scaled_mm."""

    node: Node
    path: list[Node]
    weight: Node
    bias: Node | None
    scaled: ScaledArgs | None = None


@dataclass
class Region:
    """One distributed operator found in a graph.

    kind: "ag_matmul", "matmul_rs" or "matmul_ar".
    collective / wait: the collective node and its wait_tensor.
    dim: gather dim (ag_matmul) or scatter dim (matmul_rs) in the logical layout; None for matmul_ar.
    a: the local input (ag_matmul: the shard; others: the matmul's A operand).
    consumers: the matmuls (one for matmul_rs / matmul_ar).
    root: ag_matmul: the node holding the gathered tensor (wait, or cat of the split/cat form).
    keep_gathered: ag_matmul: the gathered tensor has other users, so the op returns it too.
    path: matmul_rs / matmul_ar: the chain from the matmul output to the collective input.
    nodes: the nodes the rewrite replaces (collective side), for erasure.
    t_shape: matmul_rs / matmul_ar: shape of the product as the collective sees it.
    """

    kind: str
    collective: Node
    wait: Node
    group_name: str
    group_size: int
    dim: int | None
    a: Node
    consumers: list[Consumer]
    reduce_op: str | None = None
    root: Node | None = None
    keep_gathered: bool = False
    path: list[Node] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    in_layout: Layout | None = None
    out_layout: Layout | None = None
    t_shape: list[int] | None = None
    a_view: Any = None  # ag_matmul: the float8 dtype the gathered bytes are viewed as (gathered as uint8)

    @property
    def scaled(self) -> ScaledArgs | None:
        """The float8 arguments shared by the region's matmuls (None: plain matmuls)."""
        return self.consumers[0].scaled if self.consumers else None

    @property
    def dynamic(self) -> bool:
        """Whether a row count is symbolic (a graph compiled with dynamic shapes): the region
        then runs for every size the graph is called with, so its schedule is picked per call
        (Schedule "auto") instead of from the shape at compile time."""
        return not is_static(list(self.a.meta["val"].shape) + list(self.t_shape or []))

    def summary(self) -> dict[str, Any]:
        """JSON-able description: what explain shows and the rank-consistency hash covers."""
        a = self.a.meta["val"]
        return {
            "kind": self.kind,
            "collective": self.collective.name,
            "group": self.group_name,
            "world": self.group_size,
            "dim": self.dim,
            "reduce_op": self.reduce_op,
            "a_shape": [s if isinstance(s, int) else str(s) for s in a.shape],
            "dtype": str(a.dtype).removeprefix("torch."),
            "weights": [list(c.weight.meta["val"].shape) for c in self.consumers],
            "matmuls": [c.node.name for c in self.consumers],
            "bias": [c.bias is not None for c in self.consumers],
            "keep_gathered": self.keep_gathered,
            "layouts": f"{self.in_layout} -> {self.out_layout}",
        } | ({} if self.scaled is None else {
            "dtype": str(self.a_view or a.dtype).removeprefix("torch."),
            "scaled": {"out_dtype": str(self.scaled.out_dtype).removeprefix("torch."),
                       "fast_accum": self.scaled.fast_accum}})
