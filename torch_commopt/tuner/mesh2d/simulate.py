"""A cluster simulator for 2D tensor parallelism: the cost model (model.py) driven at scales that
cannot run here, for the FC layers of a transformer block.

Two machines:
- a TPUv4-like torus with the authors' simulation figures (their `simulation` branch: every axis
  60 GB/s all-gather and 50 GB/s reduce-scatter per direction, 6 us a hop, 100 us a collective's
  fixed cost, 249 TFLOP/s a chip): links of their own per mesh axis;
- a GPU cluster of NVLink nodes (H200: 8 GPUs a node on NVSwitch, one 400 Gb/s NIC a GPU): a mesh
  axis whose ranks share a node runs at NVLink's rate, one that crosses nodes at the NIC's; where
  both axes cross nodes their transfers share the NIC (model.MeshLinks.shared).  Its 1D
  alternative, tensor parallelism inside a node and data parallelism across nodes, is priced too.

Per algorithm (model.ALGORITHMS) and mesh shape: the FC layers' seconds (forward and both
backward GEMMs; MeshSlice with each layer's best slice count) and the FLOP utilisation, the
layers' FLOPs over chips x peak x seconds.  The rest of the block (attention's core, the
elementwise passes: rest_of_block_s) is local and the same for every algorithm; added to the FC
layers it gives the whole block's time, what an end-to-end comparison divides.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_commopt.tuner.mesh2d.model import ALGORITHMS, FCLayer, MeshLinks, layer_flops, layer_s
from torch_commopt.tuner.mesh2d.tune import best_slices, links_of, mesh_shapes

# The authors' simulation figures (hwnam831/meshslice, branch `simulation`, Autotuner.py).
TPU_V4_SIM = MeshLinks(ag_bw=(60e9, 60e9), rs_bw=(50e9, 50e9), ag_alpha_s=6e-6, rs_alpha_s=6e-6,
                       ag_overhead_s=100e-6, rs_overhead_s=100e-6, flops_per_s=249e12,
                       sr_bw=(38.801e9, 35.224e9), sr_alpha_s=6e-6, sr_overhead_s=100e-6)

# Model sizes the paper evaluates: (heads, head dim); seq 2048, batch = chips sequences.
MODELS = {"gpt3-175b": (96, 128), "megatron-nlg-530b": (160, 128)}
SEQ = 2048
# Memory bandwidth a chip: TPUv4's HBM (1.2 TB/s) and an H200's (4.8 TB/s), for the block's
# elementwise passes (rest_of_block_s).
TPU_V4_HBM_BYTES_PER_S = 1.2e12
H200_HBM_BYTES_PER_S = 4.8e12
# The block's elementwise passes, forward, in reads and writes of a token's d-wide activation:
# two layer norms (read, write: 2 each), two residual adds (two reads, a write: 3 each) and the
# FFN's activation on its 4d-wide hidden state (read, write: 8); the backward about twice that.
ELEMENTWISE_ACCESSES = 3 * (2 * 2 + 2 * 3 + 8)


@dataclass(frozen=True)
class GPUCluster:
    """Nodes of `gpus_per_node` GPUs on NVSwitch, one NIC a GPU between nodes.  Rates per GPU and
    direction as a ring collective reaches them (H200: NVLink 450 GB/s a direction, NCCL's rings
    ~360; NDR InfiniBand 400 Gb/s = 50 GB/s, ~45 reached), bf16 GEMMs at a large GEMM's rate."""

    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 360e9
    nic_bytes_per_s: float = 45e9
    nvlink_alpha_s: float = 3e-6
    nic_alpha_s: float = 8e-6
    overhead_s: float = 10e-6
    flops_per_s: float = 700e12

    def inside(self, mesh: tuple[int, int]) -> tuple[bool, bool]:
        """Whether each mesh axis's ranks share a node (ranks row-major: a row's C ranks are
        consecutive; a column's R ranks are C apart)."""
        r, c = mesh
        g = self.gpus_per_node
        col = c <= g and g % c == 0
        return col and r * c <= g, col

    def links(self, mesh: tuple[int, int]) -> MeshLinks:
        inside = self.inside(mesh)
        bw = tuple(self.nvlink_bytes_per_s if i else self.nic_bytes_per_s for i in inside)
        alpha = tuple(self.nvlink_alpha_s if i else self.nic_alpha_s for i in inside)
        return MeshLinks(ag_bw=bw, rs_bw=bw, ag_alpha_s=max(alpha), rs_alpha_s=max(alpha), ag_overhead_s=self.overhead_s,
                         rs_overhead_s=self.overhead_s, flops_per_s=self.flops_per_s, shared=not any(inside),
                         axis_alpha_s=alpha)


@dataclass(frozen=True)
class Result:
    """One algorithm at one mesh shape: the FC layers' seconds, their FLOP utilisation, and
    (MeshSlice) each layer's slice count."""

    algorithm: str
    mesh: tuple[int, int]
    seconds: float
    utilisation: float
    slices: dict


def evaluate(layers: list[FCLayer], chips: int, links, algorithm: str, mesh: tuple[int, int]) -> Result:
    """The layers under `algorithm` on `mesh` (links: MeshLinks, or mesh -> MeshLinks)."""
    lk = links_of(links, mesh)
    total, slices = 0.0, {}
    for layer in layers:
        if algorithm == "meshslice":
            slices[layer.name], seconds = best_slices(layer, mesh, lk)
            total += seconds
        else:
            total += layer_s(layer, mesh, lk, algorithm)
    flops = sum(layer_flops(layer) for layer in layers)
    return Result(algorithm, mesh, total, flops / (chips * lk.flops_per_s * total), slices)


def best(layers: list[FCLayer], chips: int, links, algorithm: str, shapes=None) -> Result:
    """The algorithm at its fastest mesh shape."""
    return min((evaluate(layers, chips, links, algorithm, mesh) for mesh in shapes or mesh_shapes(chips)),
               key=lambda r: r.seconds)


def compare(layers: list[FCLayer], chips: int, links, shapes=None) -> dict[str, Result]:
    """Every algorithm at its own best mesh shape."""
    return {alg: best(layers, chips, links, alg, shapes) for alg in ALGORITHMS}


def rest_of_block_s(heads: int, head_dim: int, flops_per_s: float, hbm_bytes_per_s: float, seq: int = SEQ) -> float:
    """A block's work besides its four FC layers, forward and backward, a chip (batch = chips
    sequences, so one sequence's worth a chip): the attention core -- QK^T and AV over causal scores,
    2 S^2 d FLOPs a sequence forward, the backward twice that, at the GEMM rate (a flash kernel:
    the scores never reach memory) -- and the elementwise passes at memory speed
    (ELEMENTWISE_ACCESSES of a token's activation, bf16).  It is local however the FC layers are
    split (each chip holds whole sequences of its heads, under 2D TP as under 1D TP), so it is the
    same for every algorithm: what makes the FC layers' speedups an end-to-end one."""
    d = heads * head_dim
    attention = 3 * 2.0 * seq * seq * d / flops_per_s
    elementwise = ELEMENTWISE_ACCESSES * seq * d * 2 / hbm_bytes_per_s
    return attention + elementwise


def _tp_step_s(layer: FCLayer, tokens: float, tp: int, cluster: GPUCluster) -> float:
    """One of a layer's three GEMMs under 1D TP over a node (async-TP: the GEMM against its
    NVLink all-gather or reduce-scatter, the longer of the two)."""
    gemm = 2.0 * tokens * layer.in_features * layer.out_features / tp / cluster.flops_per_s
    moved = max(layer.in_features, layer.out_features) * tokens * 2 * (tp - 1) / tp
    return max(gemm, cluster.overhead_s + moved / cluster.nvlink_bytes_per_s + (tp - 1) * cluster.nvlink_alpha_s)


def _nic_s(nbytes: float, dp: int, cluster: GPUCluster) -> float:
    """A ring collective over the dp nodes that leaves each GPU with nbytes (all-gather) or starts
    from them (reduce-scatter): (dp - 1) / dp of them over the GPU's NIC, a hop's latency each."""
    if dp <= 1:
        return 0.0
    return cluster.overhead_s + (dp - 1) / dp * nbytes / cluster.nic_bytes_per_s + (dp - 1) * cluster.nic_alpha_s


def _tp_layers(layers: list[FCLayer], chips: int, cluster: GPUCluster):
    """Per layer under 1D TP over a node and the nodes as the other axis: (one GEMM's step,
    _tp_step_s; a collective of its bf16 TP-shard weight or gradient over the nodes, _nic_s)."""
    tp = cluster.gpus_per_node
    dp = max(1, chips // tp)
    for layer in layers:
        shard = 2.0 * layer.in_features * layer.out_features / tp
        yield _tp_step_s(layer, layer.tokens / dp, tp, cluster), _nic_s(shard, dp, cluster)


def tp_dp_seconds(layers: list[FCLayer], chips: int, cluster: GPUCluster) -> float:
    """The 1D alternative on a GPU cluster: tensor parallelism over each node's GPUs (_tp_step_s),
    data parallelism over the nodes (each layer's weight-gradient shard all-reduced over the
    NICs, hidden behind the layer's backward where it is shorter).  Every GPU holds its TP
    shard's whole training state (weight_bytes_per_chip(..., tp))."""
    total = 0.0
    for step, shard_s in _tp_layers(layers, chips, cluster):
        all_reduce = 2 * shard_s  # reduce-scatter + all-gather of the gradient shard
        total += 3 * step + max(0.0, all_reduce - 2 * step)
    return total


def tp_fsdp_seconds(layers: list[FCLayer], chips: int, cluster: GPUCluster) -> float:
    """1D TP over each node with FSDP (ZeRO-3) over the nodes: the state split over every GPU as
    2D TP splits it (weight_bytes_per_chip(..., chips)), paid for in NIC traffic.  Each layer's
    bf16 TP-shard weight is all-gathered over the nodes before its forward and again before its
    backward, and its gradient reduce-scattered after; FSDP prefetches, so a gather runs behind
    the layer before's GEMMs: the forward takes the longer of its GEMM and its gather, the
    backward the longer of its two GEMMs and its gather plus its gradient's reduce-scatter."""
    total = 0.0
    for step, shard_s in _tp_layers(layers, chips, cluster):
        total += max(step, shard_s) + max(2 * step, 2 * shard_s)  # gather; gather + the gradient's reduce-scatter
    return total


def weight_bytes_per_chip(layers: list[FCLayer], chips: int, tp: int) -> float:
    """The FC weights' training state a chip holds (bf16 weight and gradient, fp32 Adam moments and
    master copy: 16 bytes a parameter) when the weights are split over `tp` of the `chips`."""
    params = sum(layer.in_features * layer.out_features for layer in layers)
    return 16.0 * params / tp
