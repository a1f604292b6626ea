"""Whether a compiled graph's host runs ahead of its GPU (the rule's host-bound band, CUDA).

The built-in rule times a region in the band (0.1-0.5 ms of GEMM, pick.measure_band) at its first
call, back to back on its own, where a GPU schedule's larger host enqueue (0.2-0.4 ms through its
Python host code, 0.11-0.17 ms replayed from its host trace: kernels/gpu/host_replay.py; NCCL's
~0.1-0.2) can decide.  Inside a graph whose host enqueues everything well before the GPU gets
there, that enqueue is hidden and only the GPU time counts, as when replayed from CUDA graphs.
In TP=2 training of four Llama-3-8B layers the step enqueues in 30 ms against 48 ms of busy
GPU, yet first-call timing keeps the backward's o_proj all-gather and q/k/v reduce-scatter
(ce_push:1's enqueue over the band's 1/1.5 headroom) on NCCL: ~1.3 ms of exposed NCCL a step,
where the same ce_push:1, with its host hidden, runs 1.21-1.39x NCCL's speed on the band's
shapes (docs/gpu-schedules.md, "The built-in rule").

`estimate` biases both figures against calling the host ahead: the GPU side counts only the
graph's matmuls and attention at the rule's peak rates (every attention as causal), the host
side every node that is not a view at LAUNCH_S (measured per node, everything on the host
counted in) and every region at REGION_HOST_S (above the slowest enqueue of a band region).
At that step's shapes a forward graph (43 nodes, 2.9 ms of matmuls and attention at peak) does
not count as ahead (3.3 ms of host), a backward one (69-83 nodes, 6.1 ms) does (4.4-4.9 ms).

With_backward (Config.band_in_graph="training"): a training forward graph is counted together
with the backward it implies (estimated from the forward: BWD_MATMUL times its matmuls,
ATTENTION_BWD times its attention, BWD_LAUNCHES times its launches, as many regions).  Steps run
back to back, the backward's lead carries into the next forward; with a synchronize every step
the forward starts on an empty queue.  Counted alone, that step's forward (2.95 ms GPU, 3.32 ms
host) times its two band regions at the first call and keeps NCCL (1.7 ms of NCCL a step; the
rule runs 1.033x inductor against 1.046x with GPU schedules everywhere); counted with its
backward (est. 9.0 ms GPU, 8.4 ms host) it runs ahead.  Opt-in: not yet measured across
training runs.
"""

from __future__ import annotations

import math
import operator

from torch.fx import Graph, Node

from torch_commopt.kernels.matmul.gpu.pick import GEMM_FLOPS_PER_S
from torch_commopt.passes.graph_utils import is_static, val

# A node's share of the host's enqueue: the step above enqueues in 30 ms for 8 graphs of 43-83 such
# nodes (~500) with 32 regions (~0.3 ms each), i.e. ~40 us a node with the optimizer, autograd
# and guards counted in (Inductor fuses many nodes into one kernel, so a kernel costs more).
LAUNCH_S = 40e-6
# a region's GPU-schedule call (that step's backward band: 0.17-0.38 ms a call through the Python host
# code; replayed, 0.11-0.17 ms at the training step's shapes -- kept at 0.4 until a training run
# measures what the lower figure changes)
REGION_HOST_S = 0.4e-3
ATTENTION_BWD = 2.5  # an attention backward's matmul work over its forward's
BWD_MATMUL = 2.0  # a forward matmul's backward: its input's and its weight's gradients
# A backward graph's launches over its forward's (that step: 69-83 nodes against 43, at most 1.93;
# rounded up, as every figure here leans against calling the host ahead)
BWD_LAUNCHES = 2.0
_FREE = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "squeeze", "unsqueeze",
         "slice", "select", "alias", "as_strided", "split", "split_with_sizes", "unbind", "detach",
         "getitem", "sym_size", "sym_numel", "sym_stride"}


def _name(node: Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(packet).split(".")[0]


def _shape(node) -> list[int] | None:
    """A node's static shape, None for anything else (no tensor, symbolic sizes)."""
    v = val(node)
    return list(v.shape) if v is not None and is_static(v.shape) else None


def _dtype(node: Node) -> str:
    """The dtype of the node's first tensor input (an op's result may be a tuple)."""
    for arg in node.args:
        if (v := val(arg)) is not None:
            return str(v.dtype).removeprefix("torch.")
    return "float32"


def _matmul_flops(node: Node) -> float:
    name, args = _name(node), node.args
    pairs = {"mm": (0, 1), "addmm": (1, 2), "bmm": (0, 1), "baddbmm": (1, 2), "_scaled_mm": (0, 1)}
    if name not in pairs:
        return 0.0
    a, b = (_shape(args[i]) if len(args) > i else None for i in pairs[name])
    if not a or not b:
        return 0.0
    return 2.0 * math.prod(a) * b[-1]


def _attention_flops(node: Node) -> float:
    """An SDPA forward's or backward's matmul flops, as if causal (the smaller figure)."""
    name = _name(node)
    if not name.lstrip("_").startswith("scaled_dot_product") or not node.args:
        return 0.0
    q = _shape(node.args[1] if "backward" in name and len(node.args) > 1 else node.args[0])
    k = _shape(node.args[2] if "backward" in name and len(node.args) > 2 else node.args[1])
    if not q or not k or len(q) != 4 or len(k) != 4:
        return 0.0
    fwd = 4.0 * q[0] * q[1] * q[2] * k[2] * q[3] / 2
    return fwd * (ATTENTION_BWD if "backward" in name else 1.0)


def estimate(graph: Graph, regions: int, with_backward: bool = False) -> tuple[float, float, int]:
    """(GPU seconds, host seconds, launches counted) of one call of the graph, as biased above;
    with_backward: a training forward graph's figures with its backward's estimate added."""
    matmul, attention, launches = 0.0, 0.0, 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _name(node) not in _FREE:
            launches += 1
        mm, attn = _matmul_flops(node), _attention_flops(node)
        if mm or attn:
            rate = GEMM_FLOPS_PER_S.get(_dtype(node), 50e12)
            matmul, attention = matmul + mm / rate, attention + attn / rate
    gpu, host = matmul + attention, launches * LAUNCH_S + regions * REGION_HOST_S
    if with_backward:
        bwd_launches = math.ceil(BWD_LAUNCHES * launches)
        gpu += BWD_MATMUL * matmul + ATTENTION_BWD * attention
        host += bwd_launches * LAUNCH_S + regions * REGION_HOST_S
        launches += bwd_launches
    return gpu, host, launches


def figures(gpu: float, host: float, launches: int, regions: int, with_backward: bool = False) -> str:
    """An estimate's figures as explain notes them (the start of a graph's note)."""
    what = "graph and the backward it implies" if with_backward else "graph"
    return (f"{what}: est. {gpu * 1e3:.2f} ms of matmuls and attention on the GPU, {host * 1e3:.2f} ms of "
            f"host ({launches} launches, {regions} regions{' each way' if with_backward else ''})")


def host_runs_ahead(graph: Graph, regions: int, with_backward: bool = False) -> tuple[bool, str]:
    """(whether the GPU time alone should rank the band's schedules, a note for explain)."""
    gpu, host, launches = estimate(graph, regions, with_backward)
    ahead = regions > 0 and host <= gpu
    return ahead, (figures(gpu, host, launches, regions, with_backward) + ": "
                   + ("the host runs ahead, so the band's regions are ranked by GPU time" if ahead else
                      "the host may not run ahead, so the band's regions are timed at their first call"))
