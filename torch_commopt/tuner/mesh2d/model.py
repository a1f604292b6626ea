"""Cost model of 2D GEMMs on an R x C device mesh (MeshSlice, ISCA 2025, and its baselines).

Every 2D operand is sharded over both mesh axes, P(row, col): device (i, j) holds block (i, j).
A GEMM's collectives run along one axis each: axis 0 ("row": the R devices of a column, j fixed)
and axis 1 ("col": the C devices of a row, i fixed).  Three dataflows keep one operand in place:

    OS  Y = X W        X [M, K], W [K, N]: all-gather X along col and W along row, Y stays
    LS  Y = X W^T      W stored [N, K]: X stays; all-gather W along row, reduce-scatter Y along col
    RS  Y = X^T W      X stored [K, M]: W stays; all-gather X along col, reduce-scatter Y along row

MeshSlice cuts the dimension its collectives carry (K for OS, N for LS, M for RS) into S slices and
pipelines them: slice s + 1's collectives (on both axes at once) run while slice s multiplies, so
    OS: max(ag_x, ag_w) + (S - 1) max(ag_x, ag_w, g) + g
    LS / RS: (ag + rs) + g + (S - 1) max(ag, rs, g)
with g the GEMM of one slice.  Baselines: "collective" (the whole collectives then one GEMM; as the
authors' model has it, one collective may run beside the GEMM), SUMMA (lcm(R, C) steps of panel
broadcasts, pipelined), and "wang" (the collective matmul of Wang et al.: one axis's transfer
pipelined with the GEMM in C steps of bidirectional shifts, the other axis's collective exposed).

Collectives are ring alpha-beta per axis: an all-gather of a shard of n bytes over p devices takes
o + (p - 1)(n / bw + alpha) with that axis's bandwidth (per direction) and per-hop latency; a
reduce-scatter the same with its own figures (n: the shard after it); broadcast and reduce are
pipelined, o + n / bw + (p - 1) alpha.  GEMMs take 2 m n k / flops.  bf16 operands (2 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ELEMENT_BYTES = 2  # bf16 operands, as the paper's models
DATAFLOWS = ("os", "ls", "rs")
ALGORITHMS = ("meshslice", "collective", "summa", "wang")


@dataclass(frozen=True)
class MeshLinks:
    """What the model knows of a mesh's links and chips: per axis (0: row, 1: col) the all-gather's
    and the reduce-scatter's bandwidth per direction (bytes/s), per-hop latencies and fixed
    overheads (s), and a chip's GEMM throughput (FLOP/s).  sr_*: the point-to-point shift's own
    figures (the authors' `sendrecv`, which Wang's ring steps use), where they were measured."""

    ag_bw: tuple[float, float]
    rs_bw: tuple[float, float]
    ag_alpha_s: float
    rs_alpha_s: float
    ag_overhead_s: float
    rs_overhead_s: float
    flops_per_s: float
    shared: bool = False  # both axes' transfers share one link (a GPU's NIC where both cross nodes)
    axis_alpha_s: tuple[float, float] | None = None  # per-axis hop latency, for both collectives (else theirs)
    sr_bw: tuple[float, float] | None = None  # a shift's bandwidth per axis and direction (else the all-gather's)
    sr_alpha_s: float = 0.0
    sr_overhead_s: float = 0.0

    def both(self, a: float, b: float) -> float:
        """Two transfers on different axes at once: side by side on links of their own, one after
        the other on a shared link."""
        return a + b if self.shared else max(a, b)

    def alpha(self, collective: str, axis: int) -> float:
        if self.axis_alpha_s is not None:
            return self.axis_alpha_s[axis]
        return self.ag_alpha_s if collective == "ag" else self.rs_alpha_s

    def all_gather(self, shard_bytes: float, axis: int, p: int) -> float:
        return self.ag_overhead_s + (p - 1) * (shard_bytes / self.ag_bw[axis] + self.alpha("ag", axis)) if p > 1 else 0.0

    def reduce_scatter(self, shard_bytes: float, axis: int, p: int) -> float:
        return self.rs_overhead_s + (p - 1) * (shard_bytes / self.rs_bw[axis] + self.alpha("rs", axis)) if p > 1 else 0.0

    def broadcast(self, nbytes: float, axis: int, p: int) -> float:
        return self.ag_overhead_s + nbytes / self.ag_bw[axis] + (p - 1) * self.alpha("ag", axis) if p > 1 else 0.0

    def reduce(self, nbytes: float, axis: int, p: int) -> float:
        return self.rs_overhead_s + nbytes / self.rs_bw[axis] + (p - 1) * self.alpha("rs", axis) if p > 1 else 0.0

    def ring_shift(self, nbytes: float, axis: int) -> tuple[float, float]:
        """(seconds a step, seconds once) of a ring shift moving nbytes a step, half each way round
        the axis's ring.  With point-to-point figures every step pays their latency and overhead, as
        the authors price a ring of sendrecvs (`CostModel.LogicalRing_ISplit`, Cannon); without,
        the all-gather's bandwidth and latency, and its overhead once."""
        if self.sr_bw is None:
            return nbytes / (2 * self.ag_bw[axis]) + self.alpha("ag", axis), self.ag_overhead_s
        return nbytes / (2 * self.sr_bw[axis]) + self.sr_alpha_s + self.sr_overhead_s, 0.0

    def gemm(self, m: float, n: float, k: float) -> float:
        return 2.0 * m * n * k / self.flops_per_s


def _bytes(rows: float, cols: float) -> float:
    return rows * cols * ELEMENT_BYTES


def meshslice_s(kind: str, m: int, n: int, k: int, mesh: tuple[int, int], slices: int, links: MeshLinks) -> float:
    """Seconds of one sliced 2D GEMM (kind OS, LS or RS; the module docstring's forms) of the global
    (M, N, K) on mesh (R, C) in `slices` slices."""
    r, c = mesh
    s = slices
    if kind == "os":
        ag_x = links.all_gather(_bytes(m / r, k / (c * s)), 1, c)
        ag_w = links.all_gather(_bytes(k / (r * s), n / c), 0, r)
        g = links.gemm(m / r, n / c, k / s)
        return links.both(ag_x, ag_w) + (s - 1) * max(links.both(ag_x, ag_w), g) + g
    if kind == "ls":
        ag_w = links.all_gather(_bytes(n / (r * s), k / c), 0, r)
        rs_y = links.reduce_scatter(_bytes(m / r, n / (c * s)), 1, c)
        g = links.gemm(m / r, n / s, k / c)
        return ag_w + rs_y + g + (s - 1) * max(links.both(ag_w, rs_y), g)
    if kind == "rs":
        ag_x = links.all_gather(_bytes(k / r, m / (c * s)), 1, c)
        rs_y = links.reduce_scatter(_bytes(m / (r * s), n / c), 0, r)
        g = links.gemm(m / s, n / c, k / r)
        return ag_x + rs_y + g + (s - 1) * max(links.both(ag_x, rs_y), g)
    raise ValueError(f"mesh2d: unknown dataflow {kind!r} (known: {', '.join(DATAFLOWS)})")


def collective_s(kind: str, m: int, n: int, k: int, mesh: tuple[int, int], links: MeshLinks) -> float:
    """The Collective 2D GEMM: whole-shard collectives and one GEMM; as the authors' model prices it
    (XLA's GSPMD), one of its two collectives runs beside the GEMM."""
    r, c = mesh
    if kind == "os":
        ag_x = links.all_gather(_bytes(m / r, k / c), 1, c)
        ag_w = links.all_gather(_bytes(k / r, n / c), 0, r)
        return ag_x + max(links.gemm(m / r, n / c, k), ag_w)
    if kind == "ls":
        ag_w = links.all_gather(_bytes(n / r, k / c), 0, r)
        rs_y = links.reduce_scatter(_bytes(m / r, n / c), 1, c)
        return rs_y + max(ag_w, links.gemm(m / r, n, k / c))
    if kind == "rs":
        ag_x = links.all_gather(_bytes(k / r, m / c), 1, c)
        rs_y = links.reduce_scatter(_bytes(m / r, n / c), 0, r)
        return rs_y + max(ag_x, links.gemm(m, n / c, k / r))
    raise ValueError(f"mesh2d: unknown dataflow {kind!r} (known: {', '.join(DATAFLOWS)})")


def summa_s(kind: str, m: int, n: int, k: int, mesh: tuple[int, int], links: MeshLinks) -> float:
    """SUMMA: lcm(R, C) steps, each broadcasting a panel along one axis or both (and, for LS / RS, a
    reduce of the partial output), pipelined one step ahead of the GEMM."""
    r, c = mesh
    steps = math.lcm(r, c)
    if kind == "os":
        bx = links.broadcast(_bytes(m / r, k / steps), 1, c)
        bw = links.broadcast(_bytes(k / steps, n / c), 0, r)
        g = links.gemm(m / r, n / c, k / steps)
        return links.both(bx, bw) + (steps - 1) * max(links.both(bx, bw), g) + g
    if kind == "ls":
        bw = links.broadcast(_bytes(n / steps, k / c), 0, r)
        red = links.reduce(_bytes(m / r, n / steps), 1, c)
        g = links.gemm(m / r, n / steps, k / c)
        return bw + red + (steps - 1) * max(links.both(bw, red), g) + g
    if kind == "rs":
        bx = links.broadcast(_bytes(k / r, m / steps), 1, c)
        red = links.reduce(_bytes(m / steps, n / c), 0, r)
        g = links.gemm(m / steps, n / c, k / r)
        return bx + red + (steps - 1) * max(links.both(bx, red), g) + g
    raise ValueError(f"mesh2d: unknown dataflow {kind!r} (known: {', '.join(DATAFLOWS)})")


def wang_s(kind: str, m: int, n: int, k: int, mesh: tuple[int, int], links: MeshLinks) -> float:
    """Wang et al.'s collective matmul on one axis (col), the other axis's collective exposed: C steps,
    each a GEMM of one col-block while the next halves move both ways round the col ring
    (MeshLinks.ring_shift)."""
    r, c = mesh
    if kind == "os":
        exposed = links.all_gather(_bytes(k / r, n / c), 0, r)
        moved = _bytes(m / r, k / c)
        g = links.gemm(m / r, n / c, k / c)
    elif kind == "ls":
        exposed = links.all_gather(_bytes(n / r, k / c), 0, r)
        moved = _bytes(m / r, n / c)
        g = links.gemm(m / r, n / c, k / c)
    elif kind == "rs":
        exposed = links.reduce_scatter(_bytes(m / r, n / c), 0, r)
        moved = _bytes(k / r, m / c)
        g = links.gemm(m / c, n / c, k / r)
    else:
        raise ValueError(f"mesh2d: unknown dataflow {kind!r} (known: {', '.join(DATAFLOWS)})")
    step, once = links.ring_shift(moved, 1)
    return exposed + once + c * max(g, step if c > 1 else 0.0)


# The three GEMMs of an FC layer Y = X W (X [B, I] tokens x features, W [I, O]) under each layer
# dataflow: (kernel, (M, N, K) as functions of B, I, O), forward, backward-data, backward-weight;
# a transposed layer (its activations stored [features, tokens]) runs the transposed forms.
_LAYER_GEMMS = {
    ("os", False): (("os", "BOI"), ("ls", "BIO"), ("rs", "IOB")),
    ("ls", False): (("ls", "BOI"), ("os", "BIO"), ("rs", "OIB")),
    ("rs", False): (("rs", "BOI"), ("ls", "IBO"), ("os", "IOB")),
    ("os", True): (("os", "OBI"), ("rs", "IBO"), ("ls", "OIB")),
    ("ls", True): (("rs", "OBI"), ("os", "IBO"), ("ls", "IOB")),
    ("rs", True): (("ls", "OBI"), ("rs", "BIO"), ("os", "OIB")),
}


@dataclass(frozen=True)
class FCLayer:
    """An FC layer's GEMM dimensions: B tokens, I in-features, O out-features, its dataflow and
    whether its activations are stored transposed."""

    name: str
    tokens: int
    in_features: int
    out_features: int
    dataflow: str = ""
    transposed: bool = False

    def gemms(self) -> list[tuple[str, int, int, int]]:
        """(kernel, M, N, K) of its forward, backward-data and backward-weight GEMMs."""
        dims = {"B": self.tokens, "I": self.in_features, "O": self.out_features}
        return [(kind, *(dims[x] for x in letters)) for kind, letters in _LAYER_GEMMS[(self.dataflow, self.transposed)]]

    def sliced_dim(self) -> int:
        """The dimension MeshSlice slices in the forward (its K for OS, N for LS, M for RS)."""
        return {"os": self.in_features, "ls": self.out_features, "rs": self.tokens}[self.dataflow]


def stationary_rule(tokens: int, in_features: int, out_features: int) -> str:
    """The paper's dataflow rule: keep the largest matrix in place -- the output (os) where O > I and
    B >= I, the input (ls) where I >= O and B >= O, else the weight (rs)."""
    if out_features > in_features and tokens >= in_features:
        return "os"
    if in_features >= out_features and tokens >= out_features:
        return "ls"
    return "rs"


def layer_s(layer: FCLayer, mesh: tuple[int, int], links: MeshLinks, algorithm: str = "meshslice",
            slices: int = 1) -> float:
    """Seconds of an FC layer's forward and backward GEMMs under `algorithm` (ALGORITHMS)."""
    total = 0.0
    for kind, m, n, k in layer.gemms():
        if algorithm == "meshslice":
            total += meshslice_s(kind, m, n, k, mesh, slices, links)
        elif algorithm == "collective":
            total += collective_s(kind, m, n, k, mesh, links)
        elif algorithm == "summa":
            total += summa_s(kind, m, n, k, mesh, links)
        elif algorithm == "wang":
            total += wang_s(kind, m, n, k, mesh, links)
        else:
            raise ValueError(f"mesh2d: unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
    return total


def layer_flops(layer: FCLayer) -> float:
    """FLOPs of its three GEMMs (over the whole mesh)."""
    return 3 * 2.0 * layer.tokens * layer.in_features * layer.out_features


# The authors' figures for a TPUv4 slice (their tuner's globals, hwnam831/meshslice `Autotuner.py`):
# measured on a v4-32, axis 0 across hosts and axis 1 within one (per-direction GB/s), with their
# sendrecv's for a ring shift, and the FLOP rate their tuner passes (242 TiFLOP/s; the analytic
# step does not use it).
TPU_V4 = MeshLinks(ag_bw=(27.472e9, 79.751e9), rs_bw=(37.506e9, 63.167e9), ag_alpha_s=5e-6, rs_alpha_s=5e-6,
                   ag_overhead_s=13e-6, rs_overhead_s=26e-6, flops_per_s=242 * 1024 ** 4,
                   sr_bw=(38.801e9, 35.224e9), sr_alpha_s=5e-5, sr_overhead_s=13e-6)
