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

The sync-only variant (`installed(sync=True)`, bench_e2e's `inductor sync-only`) strips the same
collectives and puts a one-element all-reduce (and its wait) where each one was, on one element of
its input: the ranks still meet wherever the program exchanges data, but move no bytes.  Between
the bound and a real program: what a program that communicates pays for the ranks' different
speeds (each waits for the slower at every exchange, where the bound pays the slower rank once a
step) and for the exchanges' latency, apart from moving the data.  Its numerics are meaningless too.

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

# per pass (sync: the sync-only one's), apart: both variants run in one process
_STATS: dict[bool, Counter] = {False: Counter(), True: Counter()}
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def _op(name: str):
    ns = torch.ops._c10d_functional
    return getattr(getattr(ns, name, None), "default", None)


def stats(sync: bool = False) -> dict[str, int]:
    """{'replaced <op>': count, 'left <op>': count, 'graphs': graphs the pass was called on}
    over every graph it has seen (sync: the sync-only pass's, its collectives 'synced <op>' too)."""
    return dict(_STATS[sync])


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


def _meet(graph: torch.fx.Graph, node: torch.fx.Node, group: str, counts: Counter) -> tuple:
    """Before `node` (a collective on `group`): a one-element all-reduce of its input's first
    element and its wait, so that the ranks meet there (the sync-only variant); the nodes added."""
    src = node.args[0]
    with graph.inserting_before(node):
        one = graph.call_function(torch.ops.aten.as_strided.default, (src, [1], [1]))
        met = graph.call_function(_op("all_reduce"), (one, "sum", group))
        done = graph.call_function(_op("wait_tensor"), (met,))
    one.meta["val"] = src.meta["val"].as_strided([1], [1])
    met.meta["val"] = done.meta["val"] = one.meta["val"].clone()
    counts[f"synced {node.target.__name__.split('.')[0]}"] += 1
    return one, met, done


def strip_collectives(graph: torch.fx.Graph, sync: bool = False) -> None:
    """Replace the functional collectives of `graph` in place (see the module docstring); sync:
    each by a one-element all-reduce where it was, its result as without (the sync-only variant)."""
    wait, gather, scatter = _op("wait_tensor"), _op("all_gather_into_tensor"), _op("reduce_scatter_tensor")
    reduce_, reduce_inplace = _op("all_reduce"), _op("all_reduce_")
    gm = graph.owning_module
    stats_ = _STATS[sync]
    added: set = set()  # the sync-only pass's own all-reduces and waits: they stay
    if sync:
        for node in [n for n in graph.nodes if n.op == "call_function"
                     and n.target in (gather, scatter, reduce_, reduce_inplace)]:
            added.update(_meet(graph, node, node.kwargs.get("group_name", node.args[-1]), stats_))  # its last argument
    for node in list(graph.nodes):
        if node.op != "call_function" or node in added:
            continue
        if node.target is wait:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            stats_["replaced wait_tensor"] += 1
        elif node.target in (reduce_, reduce_inplace):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            stats_["replaced all_reduce"] += 1
        elif node.target is scatter:
            src, world = node.args[0], node.args[2]
            with graph.inserting_before(node):
                rows = graph.call_function(torch.ops.aten.slice.Tensor, (src, 0, 0, src.meta["val"].shape[0] // world))
            rows.meta = dict(node.meta)
            node.replace_all_uses_with(rows)
            graph.erase_node(node)
            stats_["replaced reduce_scatter_tensor"] += 1
        elif node.target is gather:
            name = f"_comm_free_gathered_{node.name}"  # node names are unique in a graph
            gm.register_buffer(name, _constant(node.meta["val"]), persistent=False)
            with graph.inserting_before(node):
                const = graph.get_attr(name)
            const.meta = dict(node.meta)
            node.replace_all_uses_with(const)
            graph.erase_node(node)
            stats_["replaced all_gather_into_tensor"] += 1
        elif "_c10d_functional" in str(node.target):
            stats_[f"left {node.target}"] += 1


class _Pass(CustomGraphPass):
    def __init__(self, sync: bool = False):
        self.sync = sync

    def __call__(self, graph: torch.fx.Graph) -> None:
        _STATS[self.sync]["graphs"] += 1
        strip_collectives(graph, self.sync)

    def uuid(self) -> str:
        return f"torch_commopt benchmarks comm_free v1{' sync' if self.sync else ''}"


PASS, SYNC_PASS = _Pass(), _Pass(sync=True)
OPTIONS = {"post_grad_custom_post_pass": PASS, "fx_graph_cache": False}
SYNC_OPTIONS = {"post_grad_custom_post_pass": SYNC_PASS, "fx_graph_cache": False}


@contextlib.contextmanager
def installed(sync: bool = False):
    """Inductor compiles with the collectives stripped inside this context (sync: the sync-only
    variant's pass)."""
    import torch._functorch.config as functorch_config

    with torch._inductor.config.patch(SYNC_OPTIONS if sync else OPTIONS), functorch_config.patch(
            enable_autograd_cache=False):
        yield
