"""A bound, not a backend: Inductor's program with its collectives replaced by local stand-ins.

bench_e2e's `inductor comm-free` variant compiles the same blocks with Inductor and this
post-grad pass, which takes every functional collective out of the forward and backward
graphs: an all-gather's output becomes a constant of random data of its shape (so the matmul
that reads it reads realistic bytes and nothing is copied), a reduce-scatter's output the
first rows of its input (a view), an all-reduce's its input, a wait its argument.  What is
left is the step's computation with no communication at all: the time any overlap of that
communication could at best reach on these GPUs (at their power cap, the clocks included).
Its numerics are meaningless (its losses are not compared).  A collective the pass does not
know is left in place and counted (`stats()`), so a bound that still communicates is visible.
Collectives outside the compiled graphs (DTensor's eager all-reduces of the replicated norm
weights' gradients) stay, as in every variant.

Used two ways at once (bench_e2e): `OPTIONS`, the variant's own Inductor compile options (so
that Dynamo does not take the inductor variant's compiled entries for its blocks: on torch 2.11
two `block.compile()` of equal options share them, and the pass never ran), and `installed()`,
a context that sets the same options while the variant's steps compile (AOTAutograd compiles
the backward at its first call), with the FX graph and AOTAutograd caches off, so that no
cached program of another variant is reused.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

_STATS: Counter = Counter()
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _op(name: str):
    ns = torch.ops._c10d_functional
    return getattr(getattr(ns, name, None), "default", None)


def stats() -> dict[str, int]:
    """{'replaced <op>': count, 'left <op>': count, 'graphs': graphs the pass was called on}
    over every graph it has seen."""
    return dict(_STATS)


def valid(counts: dict[str, int]) -> bool:
    """Whether `stats()`-like counts describe a bound: collectives replaced, none left."""
    return any(k.startswith("replaced") for k in counts) and not any(k.startswith("left") for k in counts)


def _constant(val) -> torch.Tensor:
    """One random tensor per (shape, dtype, device), shared by every graph that needs it."""
    key = (tuple(val.shape), val.dtype, str(val.device))
    if key not in _CONSTANTS:
        gen = torch.Generator(device=val.device).manual_seed(7)
        _CONSTANTS[key] = torch.randn(*val.shape, generator=gen, dtype=torch.float32, device=val.device).to(val.dtype)
    return _CONSTANTS[key]


def strip_collectives(graph: torch.fx.Graph) -> None:
    """Replace the functional collectives of `graph` in place (see the module docstring)."""
    wait, gather, scatter = _op("wait_tensor"), _op("all_gather_into_tensor"), _op("reduce_scatter_tensor")
    reduce_, reduce_inplace = _op("all_reduce"), _op("all_reduce_")
    gm = graph.owning_module
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is wait:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            _STATS["replaced wait_tensor"] += 1
        elif node.target in (reduce_, reduce_inplace):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            _STATS["replaced all_reduce"] += 1
        elif node.target is scatter:
            src, world = node.args[0], node.args[2]
            with graph.inserting_before(node):
                rows = graph.call_function(torch.ops.aten.slice.Tensor, (src, 0, 0, src.meta["val"].shape[0] // world))
            rows.meta = dict(node.meta)
            node.replace_all_uses_with(rows)
            graph.erase_node(node)
            _STATS["replaced reduce_scatter_tensor"] += 1
        elif node.target is gather:
            name = f"_comm_free_gathered_{node.name}"  # node names are unique in a graph
            gm.register_buffer(name, _constant(node.meta["val"]), persistent=False)
            with graph.inserting_before(node):
                const = graph.get_attr(name)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
            graph.erase_node(node)
            _STATS["replaced all_gather_into_tensor"] += 1
        elif "_c10d_functional" in str(node.target):
            _STATS[f"left {node.target}"] += 1


class _Pass(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _STATS["graphs"] += 1
        strip_collectives(graph)

    def uuid(self) -> str:
        return "torch_commopt benchmarks comm_free v1"


PASS = _Pass()
OPTIONS = {"post_grad_custom_post_pass": PASS, "fx_graph_cache": False}


@contextlib.contextmanager
def installed():
    """Inductor compiles with the collectives stripped inside this context."""
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(OPTIONS), functorch_config.patch(enable_autograd_cache=False):
        yield
