"""MeshSlice's tuner: each FC layer's dataflow by the paper's rule, then the mesh shape and every
layer's slice count S -- by the paper's analytic scores, and exactly by the cost model.

The analytic step (as the authors' tuner runs it, `Autotuner.analyticalAutotune`) scores a mesh shape
by the FC layers' traffic time (what crosses each axis, at its bandwidth, spread over the chips;
independent of S) plus their latency (S rounds of per-hop latencies and overheads), and picks each
layer's S minimising latency + 2 x the pipeline's fill and drain (its exposed first and last slice:
traffic / S).  The exact step prices every (shape, S) with model.meshslice_s and keeps the fastest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_commopt.tuner.mesh2d.model import FCLayer, MeshLinks, layer_s, stationary_rule

SLICE_GRANULE = 8  # elements of a slice's smallest piece on one device (the paper's b)
MIN_SLICES, MAX_SLICES = 3, 24  # the slice counts the paper's tuner considers


def transformer_block(tokens: int, dim: int) -> list[FCLayer]:
    """A GPT-style block's four FC layers (q/k/v in, attention out, FFN up 4x, FFN down), each with
    the paper's dataflow and transposition: an rs layer stores its output transposed, and an input
    follows its producer's (the residual adds take the untransposed form)."""
    shapes = [("in_proj", dim, 3 * dim), ("out_proj", dim, dim), ("ff1", dim, 4 * dim), ("ff2", 4 * dim, dim)]
    layers, flag = [], False
    for name, i, o in shapes:
        if name == "ff1":
            flag = False  # after the residual add (a transpose where the two sides differ)
        flow = stationary_rule(tokens, i, o)
        layers.append(FCLayer(name, tokens, i, o, flow, flag))
        flag = (not flag) if flow == "rs" else flag
    return layers


def mesh_shapes(chips: int, min_side: int = 4) -> list[tuple[int, int]]:
    """(rows, cols) with rows doubling from min_side while cols >= min_side (the paper's candidates)."""
    shapes, rows = [], min_side
    while chips % rows == 0 and chips // rows >= min_side:
        shapes.append((rows, chips // rows))
        rows *= 2
    return shapes


def slice_counts(layer: FCLayer, mesh: tuple[int, int]) -> list[int]:
    """The S a layer may take on a mesh: divisors of its sliced dimension's granules per device
    pair (sliced_dim / lcm(R, C) / SLICE_GRANULE) from MIN_SLICES to MAX_SLICES; where none, the
    granule count itself (or 1)."""
    granules = layer.sliced_dim() // math.lcm(*mesh) // SLICE_GRANULE
    counts = [s for s in range(MIN_SLICES, MAX_SLICES + 1) if granules % s == 0]
    return counts or [max(1, granules)]


def _axis_traffic(layer: FCLayer, mesh: tuple[int, int]) -> tuple[tuple[str, float, int], tuple[str, float, int]]:
    """The two operands whose collectives a layer's forward runs: (which, bytes crossing all links
    of its axis, that axis); the output-stationary layer moves its input and weight, the
    input-stationary its weight and output, the weight-stationary its input and output."""
    b, i, o = layer.tokens, layer.in_features, layer.out_features
    x_axis, w_axis = (0, 1) if layer.transposed else (1, 0)
    other = {0: 1, 1: 0}
    sizes = {"x": 2 * b * i, "w": 2 * i * o, "y": 2 * b * o}
    pairs = {"os": (("x", x_axis), ("w", w_axis)), "ls": (("w", w_axis), ("y", other[w_axis])),
             "rs": (("x", x_axis), ("y", other[x_axis]))}[layer.dataflow]
    return tuple((name, sizes[name] * (mesh[axis] - 1), axis) for name, axis in pairs)


# which collective each of the two operands takes in (forward, backward-data, backward-weight)
_PASSES = {"os": (("ag", "ag"), ("rs", "ag"), ("ag", "rs")), "ls": (("ag", "rs"), ("ag", "ag"), ("rs", "ag")),
           "rs": (("ag", "rs"), ("rs", "ag"), ("ag", "ag"))}


def traffic_s(layer: FCLayer, mesh: tuple[int, int], links: MeshLinks) -> float:
    """The paper's traffic time of a layer's three GEMMs: per pass the slower of its two operands'
    transfers (bytes over all links of the axis / that collective's bandwidth), over the chips."""
    (_, n1, a1), (_, n2, a2) = _axis_traffic(layer, mesh)
    total = 0.0
    for c1, c2 in _PASSES[layer.dataflow]:
        bw1 = (links.ag_bw if c1 == "ag" else links.rs_bw)[a1]
        bw2 = (links.ag_bw if c2 == "ag" else links.rs_bw)[a2]
        total += max(n1 / bw1, n2 / bw2)
    return total / (mesh[0] * mesh[1])


def latency_s(layer: FCLayer, mesh: tuple[int, int], links: MeshLinks, slices: int) -> float:
    """The paper's latency of a layer's three GEMMs in S slices: per pass S rounds of the slower
    operand's (p - 1) hops and fixed overhead."""
    (_, _, a1), (_, _, a2) = _axis_traffic(layer, mesh)

    def hop(coll: str, axis: int) -> float:
        alpha, o = (links.ag_alpha_s, links.ag_overhead_s) if coll == "ag" else (links.rs_alpha_s, links.rs_overhead_s)
        return (mesh[axis] - 1) * alpha + o
    return sum(slices * max(hop(c1, a1), hop(c2, a2)) for c1, c2 in _PASSES[layer.dataflow])


def pipeline_s(layer: FCLayer, mesh: tuple[int, int], links: MeshLinks, slices: int) -> float:
    """The paper's fill-and-drain of a layer's three sliced GEMMs: the first slice's transfers
    (both operands at once where they are two all-gathers, else one after the other), over S and
    the chips."""
    (_, n1, a1), (_, n2, a2) = _axis_traffic(layer, mesh)
    total = 0.0
    for c1, c2 in _PASSES[layer.dataflow]:
        t1 = n1 / (links.ag_bw if c1 == "ag" else links.rs_bw)[a1]
        t2 = n2 / (links.ag_bw if c2 == "ag" else links.rs_bw)[a2]
        total += max(t1, t2) if c1 == c2 == "ag" else t1 + t2
    return total / (mesh[0] * mesh[1]) / slices


@dataclass(frozen=True)
class Plan:
    """A tuner's answer: the mesh shape, each layer's slice count, and its score (analytic: the
    traffic + latency the paper ranks shapes by; exact: the model's seconds of the layers)."""

    mesh: tuple[int, int]
    slices: dict[str, int]
    score_s: float


def links_of(links, mesh: tuple[int, int]) -> MeshLinks:
    """links, or links(mesh) where the figures depend on the shape (a GPU cluster's nodes)."""
    return links(mesh) if callable(links) else links


def best_slices(layer: FCLayer, mesh: tuple[int, int], links: MeshLinks) -> tuple[int, float]:
    """(S, seconds) of the layer's fastest slice count on the mesh, by the cost model."""
    times = {s: layer_s(layer, mesh, links, "meshslice", s) for s in slice_counts(layer, mesh)}
    s = min(times, key=times.get)
    return s, times[s]


def analytic_plan(layers: list[FCLayer], chips: int, links, shapes=None) -> Plan:
    """The paper's analytic tuner (module docstring); links: MeshLinks, or mesh -> MeshLinks."""
    best = None
    for mesh in shapes or mesh_shapes(chips):
        links_here, slices, score = links_of(links, mesh), {}, 0.0
        for layer in layers:
            score += traffic_s(layer, mesh, links_here)
            s = min(slice_counts(layer, mesh),
                    key=lambda s: latency_s(layer, mesh, links_here, s) + 2 * pipeline_s(layer, mesh, links_here, s))
            slices[layer.name] = s
            score += latency_s(layer, mesh, links_here, s)
        if best is None or score < best.score_s:
            best = Plan(mesh, slices, score)
    return best


def exact_plan(layers: list[FCLayer], chips: int, links, shapes=None) -> Plan:
    """Every shape and every layer's every S priced by the cost model; the fastest."""
    best = None
    for mesh in shapes or mesh_shapes(chips):
        links_here, slices, total = links_of(links, mesh), {}, 0.0
        for layer in layers:
            slices[layer.name], seconds = best_slices(layer, mesh, links_here)
            total += seconds
        if best is None or total < best.score_s:
            best = Plan(mesh, slices, total)
    return best
