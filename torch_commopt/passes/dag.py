"""The region DAG of a graph: which region's output reaches which region's input, through
which other ops, and the reshard that edge needs between the two layouts.  Analysis only
(the plan search's edges; explain's plan view); computed on the graph before the rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from torch_commopt.passes.graph_utils import size_hint, val
from torch_commopt.passes.regions import Region
from torch_commopt.reshard.layouts import Layout, Replicate, Shard, reshard


@dataclass(frozen=True)
class Edge:
    src: int  # index of the producing region
    dst: int  # index of the consuming region
    via: tuple[str, ...]  # targets of the ops in between (names), in graph order
    reshard: str  # the collective the layouts ask for on this edge ("none" when they agree)
    time_ms: float = 0.0  # that collective's predicted time (layouts.reshard; 0 for none/slice)
    mib: float = 0.0  # the memory it holds while it runs

    def describe(self, regions: list[Region]) -> str:
        u, v = regions[self.src], regions[self.dst]
        through = f" via {', '.join(self.via)}" if self.via else " directly"
        cost = f" ({self.time_ms:.3f} ms, {self.mib:.0f} MiB)" if self.time_ms or self.mib else ""
        return (f"{u.collective.name} (out {io_layouts(u)[1]}) -> {v.collective.name} (in {io_layouts(v)[0]})"
                f"{through}; reshard: {self.reshard}{cost}")


def io_layouts(region: Region) -> tuple[Layout | None, Layout | None]:
    """The row layout of the region's input and output as the program sees them.  An
    all-gather region takes a shard and gives full rows; a reduction region takes full rows
    (its A operand, sharded along K) and gives its collective's result layout."""
    if region.kind == "ag_matmul":
        return region.in_layout, Replicate()
    return Replicate(), region.out_layout


def _outputs(region: Region) -> list[Node]:
    if region.kind == "ag_matmul":
        return [c.node for c in region.consumers] + ([region.root] if region.keep_gathered and region.root else [])
    return [region.wait]


def _inputs(region: Region) -> set[Node]:
    if region.kind == "ag_matmul":
        return {region.a} | {c.weight for c in region.consumers}
    (consumer,) = region.consumers
    return {region.a, consumer.weight}


def region_edges(regions: list[Region], max_nodes: int = 10_000, cal=None) -> list[Edge]:
    """Edges u -> v where a value produced by region u reaches an input of region v without
    passing through another region's output (forward walk over users), each with the reshard
    its layouts ask for, priced for the producing output's size with the calibration `cal`
    (None: the reference priors of the output's device)."""
    owner_in: dict[Node, list[int]] = {}
    for j, r in enumerate(regions):
        for n in _inputs(r):
            owner_in.setdefault(n, []).append(j)
    produced = {n: i for i, r in enumerate(regions) for n in _outputs(r)}
    inner = {n for r in regions for n in r.nodes} | {c.node for r in regions for c in r.consumers} | \
        {n for r in regions for n in r.path}
    edges: dict[tuple[int, int], tuple[tuple[str, ...], Node]] = {}
    for i, r in enumerate(regions):
        stack = [(n, (), n) for n in _outputs(r)]
        seen: set[Node] = set()
        while stack and len(seen) < max_nodes:
            node, via, origin = stack.pop()
            for j in owner_in.get(node, []):
                if j != i and (i, j) not in edges:
                    edges[(i, j)] = via, origin
            for user in node.users:
                if user in seen or user.op != "call_function":
                    continue
                seen.add(user)
                if user in produced and produced[user] != i:
                    continue  # another region's output: its own edges start there
                step = via if user in inner else via + (_name(user),)
                stack.append((user, step, origin))
    out = []
    for (i, j), (via, origin) in sorted(edges.items(), key=lambda kv: kv[0]):
        src, dst = io_layouts(regions[i])[1], io_layouts(regions[j])[0]
        if src is None or dst is None:
            out.append(Edge(i, j, via, "unknown"))
            continue
        world = regions[i].group_size
        t = val(origin)
        # (a dynamic size priced at the size it was traced with)
        full = 0 if t is None else size_hint(t.numel()) * t.element_size() * (world if isinstance(src, Shard) else 1)
        try:
            cost = reshard(src, dst, full, world, cal if cal is not None else _prior(t, world))
        except ValueError as e:
            out.append(Edge(i, j, via, f"none possible ({e})"))
            continue
        out.append(Edge(i, j, via, cost.kind, cost.time * 1e3, cost.memory / 2**20))
    return out


def _prior(t, world: int):
    from torch_commopt.tuner.calibration import prior
    from torch_commopt.tuner.machine import device_name

    return prior(device_name(t.device) if t is not None else "cpu", world)


def _name(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)
