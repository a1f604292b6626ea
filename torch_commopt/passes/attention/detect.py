"""Find context-parallel attention regions in a post-grad FX graph: analysis only, no mutation.

Two forward forms, attention being any of aten's SDPA ops (flash, efficient, cuDNN, CPU flash,
or scaled_dot_product_attention itself) on (B, H, S, D) operands, and flex_attention on a local Q
with K/V all-gathered along the sequence (_flex_region; its other forms are reported as Skips):

  allgather_kv  K and V each all-gathered along the sequence: all_gather_into_tensor -> wait
                (-> split(dim 0) -> W getitems -> cat(dim g): the form funcol and DTensor emit
                for a gather dim g > 0), then layout-only ops (permute, transpose, views that
                keep the gathered dim whole, clones) that bring the gathered dim to the
                attention's sequence dim 2; Q local (S_q * W == S_kv, not gathered).
  decode_kv     the same gathers with a few queries (S_q <= 16, not a shard): decoding over a
                sequence-sharded KV cache, an optional mask over the whole cache.
  ulysses       Q, K and V each from all_to_all_single -> wait -> layout-only ops, attention on
                the full sequence (S_q == S_kv), its output -> layout-only ops -> all_to_all_single.

Head-parallel attention (TP without sequence sharding, or sequence parallelism whose gather
feeds the q/k/v projections) yields nothing: the operands trace back to matmuls, not to
collectives.  An attention op whose K or V does come from a collective but which cannot be
taken as is (explicit mask, dropout, is_causal on a local query block, only one of K/V
gathered, Q gathered too, a gather on another dim, mixed groups) is reported as a Skip with
the reason.  Backward graphs hold no forward form (the gathered K/V arrive saved; the
backward's dK/dV drain into reduce-scatters) and yield nothing.

Nothing here mutates the graph, and `find_attention` is not part of the backend's pass
pipeline.  What wiring it in needs: the post-grad graphs are already split into forward and
backward, and the backward expects the gathered K/V the forward saves, so swapping the forward
region for cp_attention_fwd alone cannot free them; the rewrite belongs before the partition
(a pre-grad or joint-graph pass) with an autograd formula registered on cp_attention_fwd (so
the partitioner saves q, the local k/v, out and lse, and the backward calls cp_attention_bwd),
or it must rewrite the forward and backward graphs as a pair.  Ulysses inputs are in the
program's layout ((B, S_loc, H, D) before the all-to-all's own relayout): the rewrite has to
find the sequence and head dims there and permute to the op's (B, H, S_loc, D).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import Graph, Node

from torch_commopt.core.attention_spec import AttentionShape
from torch_commopt.passes.attention.mask_forms import boolean_of, fills, producers
from torch_commopt.passes.graph_utils import (
    ALL_GATHER,
    ALL_TO_ALL,
    RESHAPES,
    SPLITS,
    WAIT,
    Unsupported,
    aten,
    cat_dim,
    equal_parts,
    group_name_of,
    is_getitem,
    only_user,
    split_cat_dim,
    static_shape,
    val,
)
from torch_commopt.report import Skip

log = logging.getLogger("torch_commopt.passes.attention.detect")

ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
    aten._scaled_dot_product_cudnn_attention.default: "cudnn",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "cpu_flash",
    aten.scaled_dot_product_attention.default: "sdpa",
}
# single-input ops that only move or copy elements (no arithmetic, nothing dropped)
LAYOUT_OPS = RESHAPES | {aten.permute.default, aten.transpose.int, aten.clone.default, aten.alias.default,
                         aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default}
SEQ_DIM = 2  # of the attention's (B, H, S, D) operands
FLEX_ATTENTION = getattr(torch.ops.higher_order, "flex_attention", None)
FLEX_BACKWARD = getattr(torch.ops.higher_order, "flex_attention_backward", None)
# the backward ops a joint graph holds beside the forward ones (they read the forward's output)
ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention.default: aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default:
        aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default: aten._scaled_dot_product_cudnn_attention_backward.default,
}


@dataclass(frozen=True)
class FlexMask:
    """A flex_attention region's mask as the graph holds it: the block tables [kv_num, kv_idx,
    full_num, full_idx] (nodes, or None), the mask graph's buffers (nodes), the mask graph's code
    (`def forward(self, b, h, q, kv, *buffers)`), and [rows, keys, block size]; and the forward's
    LSE output node where something uses it."""

    tables: list
    buffers: list
    code: str
    sizes: list
    lse: Optional[Node] = None  # the forward's log-sum-exp output where the graph uses it (a joint graph's backward)
    dense: bool = False  # SDPA's dense boolean mask (buffers[0]); the tables are made from it at run time


@dataclass
class AttentionRegion:
    """One context-parallel attention found in a graph.

    form: "allgather_kv", "ulysses", "decode_kv" (allgather_kv's gathers with a few queries that
        are not a sequence shard: decoding over a sequence-sharded cache; inputs["mask"]: its mask
        over the whole cache, if any), "flex_allgather_kv" (allgather_kv into flex_attention:
        `flex` holds its mask) or "flex_ulysses" (ulysses around flex_attention, the mask the whole
        sequence's).  attention: the SDPA (or flex) node; op: its kind (ATTENTION_OPS).
    shape: the global attention (batch, heads, kv heads, total sequence, head dim).
    inputs: {"q", "k", "v"} -> the local (sequence-sharded) tensors before their collective:
        allgather_kv: q is the attention's own q, k/v the all-gathers' inputs; ulysses: the
        tensors the layout ops before each all-to-all start from.
    paths: allgather_kv: {"k", "v"} -> layout ops from the gathered tensor to the attention;
        ulysses: {"q_pre", ...} -> layout ops from an input to its all-to-all, {"q_post", ...}
        from the all-to-all's wait to the attention, "out" from the attention's output to the
        output all-to-all.
    collectives: the gathers of K and V, or the four all-to-alls (q, k, v, out).
    output: the node that delivers the region's result (the attention's output, or the wait
        of the output all-to-all).
    """

    form: str
    attention: Node
    op: str
    group_name: str
    world: int
    shape: AttentionShape
    causal: bool
    scale: Optional[float]
    inputs: dict[str, Node]
    collectives: list[Node]
    output: Node
    paths: dict[str, list[Node]] = field(default_factory=dict)
    flex: Optional[FlexMask] = None

    def summary(self) -> dict[str, Any]:
        """JSON-able description (what explain would show)."""
        return {"kind": "attention", "form": self.form, "op": self.op, "attention": self.attention.name,
                "group": self.group_name, "world": self.world, "shape": list(self.shape), "causal": self.causal,
                "scale": self.scale, "inputs": {k: n.name for k, n in self.inputs.items()},
                "input_shapes": {k: static_shape(n) for k, n in self.inputs.items()},
                "collectives": [n.name for n in self.collectives], "output": self.output.name}


def find_attention(graph: Graph) -> tuple[list[AttentionRegion], list[Skip]]:
    """Context-parallel attention regions of `graph`, and the attention ops fed by a collective
    that were left alone (with the reason)."""
    regions, skips = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is FLEX_ATTENTION:
            try:
                region = _flex_region(node)
            except Unsupported as e:
                skips.append(Skip("attention", node.name, f"flex_attention: {e}"))
                log.info("attention %s left alone: %s", node.name, e)
                continue
            if region is not None:
                regions.append(region)
            continue
        if node.op != "call_function" or node.target not in ATTENTION_OPS:
            continue
        try:
            region = _region_of(node)
        except Unsupported as e:
            skips.append(Skip("attention", node.name, str(e)))
            log.debug("attention %s left alone: %s", node.name, e)
            continue
        if region is not None:
            regions.append(region)
    return regions, skips


def _region_of(node: Node) -> Optional[AttentionRegion]:
    args = _bound(node)
    sources = {name: trace_back(args[name]) for name in ("query", "key", "value")}
    kinds = {name: _collective_kind(origin) for name, (origin, _) in sources.items()}
    if not any(kinds.values()):
        return None  # head-parallel or plain attention: not ours
    mask = args.get("attn_mask") if args.get("attn_mask") is not None else args.get("attn_bias")
    if args.get("dropout_p"):
        raise Unsupported(f"dropout_p={args['dropout_p']}")
    if kinds["query"] == kinds["key"] == kinds["value"] == "all_to_all":
        if mask is not None:
            raise Unsupported("explicit attention mask (the cp ops take is_causal only)")
        return _ulysses(node, args, sources)
    if kinds["key"] == kinds["value"] == "all_gather" and kinds["query"] is None:
        return _allgather_kv(node, args, sources, mask)
    raise Unsupported(f"operands come from {kinds['query']} (q), {kinds['key']} (k), {kinds['value']} (v): "
                      "neither K/V gathered with a local Q nor all-to-alls on all three")


def _flex_region(node: Node) -> Optional[AttentionRegion]:
    """flex_attention on a local Q and K/V all-gathered along the sequence (what a
    context-parallel program and torch's context_parallel hand it), its mask stated for the
    rank's rows against every key; None where no operand comes from a collective."""
    sources = {name: trace_back(node.args[i]) for i, name in ((0, "query"), (1, "key"), (2, "value"))}
    kinds = {name: _collective_kind(origin) for name, (origin, _) in sources.items()}
    if not any(kinds.values()):
        return None
    ulysses = kinds["query"] == kinds["key"] == kinds["value"] == "all_to_all"
    if not ulysses and not (kinds["key"] == kinds["value"] == "all_gather" and kinds["query"] is None):
        raise Unsupported(f"operands from {kinds['query']} (q), {kinds['key']} (k), {kinds['value']} (v): only K/V "
                          "all-gathered into a local Q, or all three from all-to-alls (Ulysses), is taken")
    if any(not is_getitem(u) or u.args[1] not in (0, 1) for u in node.users):
        raise Unsupported("its max scores are used")
    if not _is_identity(_submodule(node, node.args[3])):
        raise Unsupported("a score_mod (only a mask_mod is taken)")
    if node.args[7]:
        raise Unsupported("score_mod buffers")
    table = node.args[4]
    q_len, kv_len, q_block, kv_block = table[0], table[1], table[-3], table[-2]
    if any(t is not None for t in table[10:-3]):
        raise Unsupported("dq write-order tables")
    if ulysses:
        return _flex_ulysses(node, sources, table)
    gathers, paths, group_name, world = _kv_gathers(sources)
    if not all(isinstance(x, int) for x in (q_len, kv_len, q_block, kv_block)):
        raise Unsupported("symbolic sequence lengths or block sizes")
    if q_len * world != kv_len or q_block != kv_block or q_len % q_block:
        raise Unsupported(f"a {q_len} x {kv_len} mask of {q_block} x {kv_block} blocks over {world} ranks is not the "
                          "rank's rows against every key in whole square blocks")
    q, k = static_shape(node.args[0]), static_shape(node.args[1])
    lse = next((u for u in node.users if u.args[1] == 1 and u.users), None)
    mask = FlexMask(list(table[2:6]), list(node.args[8]), _mask_code(_submodule(node, table[-1])), [q_len, kv_len, q_block],
                    lse)
    inputs = {"q": node.args[0], "k": gathers["k"].args[0], "v": gathers["v"].args[0]}
    return AttentionRegion("flex_allgather_kv", node, "flex_attention", group_name, world,
                           AttentionShape(q[0], q[1], k[1], kv_len, q[3]), False, node.args[5], inputs,
                           list(gathers.values()), _output_of(node), paths, mask)


def _flex_ulysses(node: Node, sources: dict, table: tuple) -> AttentionRegion:
    """flex_attention between Ulysses all-to-alls: every rank's heads over the whole sequence, its
    mask the whole sequence's, the same on every rank (one mask for every head: a rank's program
    holds only its own heads' masks, the rewritten op needs every head's)."""
    operands = {"query": node.args[0], "key": node.args[1], "value": node.args[2]}
    region = _ulysses_region(node, operands, sources, "flex_attention", False, node.args[5], "flex_ulysses")
    q_len, kv_len, block = table[0], table[1], table[-3]
    seq = region.shape.seq
    if not all(isinstance(x, int) for x in (q_len, kv_len, block, table[-2])):
        raise Unsupported("symbolic sequence lengths or block sizes")
    if q_len != seq or kv_len != seq or block != table[-2] or seq % (region.world * block):
        raise Unsupported(f"a {q_len} x {kv_len} mask of {block} x {table[-2]} blocks is not the whole {seq}-token "
                          f"sequence's in {region.world} shares of whole square blocks")
    if static_shape(table[2])[1] != 1:
        raise Unsupported("a mask per head (each rank's program holds its own heads' masks only)")
    lse = next((u for u in node.users if u.args[1] == 1 and u.users), None)
    flex = FlexMask(list(table[2:6]), list(node.args[8]), _mask_code(_submodule(node, table[-1])), [seq, seq, block],
                    lse)
    return dataclasses.replace(region, flex=flex)


def _submodule(node: Node, ref: Node) -> torch.fx.GraphModule:
    """The graph module a get_attr argument of `node` names."""
    if not isinstance(ref, Node) or ref.op != "get_attr":
        raise Unsupported(f"{node.name}: a score/mask function that is not a graph attribute")
    return getattr(node.graph.owning_module, ref.target)


def _mask_code(gm: torch.fx.GraphModule) -> str:
    """The mask graph's code as an op carries it (run without its module: flex.mask_from_code), its
    dead nodes dropped -- Inductor's passes leave unused constant attributes in it."""
    import copy

    graph = copy.deepcopy(gm.graph)
    graph.eliminate_dead_code()
    if any(n.op in ("get_attr", "call_module") for n in graph.nodes):
        raise Unsupported("a mask function that holds constant tensors or modules")
    return torch.fx.GraphModule(gm, graph).code


def _is_identity(gm: torch.fx.GraphModule) -> bool:
    """Whether a score_mod graph returns its score (its first input) unchanged."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return bool(placeholders) and out is placeholders[0]


def _bound(node: Node) -> dict[str, Any]:
    """The op's arguments by schema name (defaults filled in)."""
    bound = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


def trace_back(node: Any) -> tuple[Any, list[Node]]:
    """(origin, path): walk up through layout-only ops; path runs from origin (exclusive) to
    `node` (inclusive), in graph order."""
    path = []
    while isinstance(node, Node) and node.op == "call_function" and node.target in LAYOUT_OPS:
        path.append(node)
        node = node.args[0]
    return node, path[::-1]


def _collective_kind(origin: Any) -> Optional[str]:
    """"all_gather" / "all_to_all" when `origin` holds a collective's waited result (for a
    gather also the split/cat form), else None."""
    if not isinstance(origin, Node):
        return None
    if origin.target is aten.cat.default and origin.args[0] and is_getitem(origin.args[0][0]):
        split = origin.args[0][0].args[0]  # cat <- getitems <- split <- (wait?)
        if split.target not in SPLITS:
            return None
        origin = split.args[0]
    if origin.target is not WAIT or not isinstance(origin.args[0], Node):
        return None
    return {ALL_GATHER: "all_gather", ALL_TO_ALL: "all_to_all"}.get(origin.args[0].target)


# ---- allgather_kv ----------------------------------------------------------------------------

def _gather_of(origin: Node) -> tuple[Node, int]:
    """(the all_gather node, the gathered dim of `origin`'s tensor)."""
    if origin.target is WAIT:
        return origin.args[0], 0
    split = origin.args[0][0].args[0]
    wait = split.args[0]
    form = split_cat_dim(split, wait.args[0].args[1])
    if form is None or form[0] != 0 or form[1] is not origin:
        raise Unsupported(f"{origin.name}: a split/cat after the gather that is not its relayout")
    return wait.args[0], cat_dim(origin)


def _kv_gathers(sources: dict) -> tuple[dict, dict, str, int]:
    """(the K and V gathers, their layout paths, the group, its size): each all-gathered along a dim
    that lands on the sequence dim, both over one group."""
    gathers, paths = {}, {}
    for name, key in (("key", "k"), ("value", "v")):
        origin, path = sources[name]
        gather, dim = _gather_of(origin)
        landed = _map_dim(dim, origin, path)
        if landed != SEQ_DIM:
            where = "lost in a reshape" if landed is None else f"lands on dim {landed}"
            raise Unsupported(f"{name} is gathered along a dim that {where}, not the sequence dim {SEQ_DIM}")
        gathers[key], paths[key] = gather, path
    groups = {(group_name_of(g.args[2]), g.args[1]) for g in gathers.values()}
    if len(groups) != 1:
        raise Unsupported(f"K and V are gathered over different groups {sorted(groups)}")
    (group_name, world), = groups
    return gathers, paths, group_name, world


def _allgather_kv(node: Node, args: dict, sources: dict, mask: Any = None) -> AttentionRegion:
    gathers, paths, group_name, world = _kv_gathers(sources)
    q, k = static_shape(args["query"]), static_shape(args["key"])
    if q[SEQ_DIM] * world != k[SEQ_DIM] and q[SEQ_DIM] <= DECODE_MAX_QUERIES:
        return _decode_kv(node, args, gathers, paths, group_name, world, mask)
    if q[SEQ_DIM] * world != k[SEQ_DIM]:
        raise Unsupported(f"q holds {q[SEQ_DIM]} positions, gathered k {k[SEQ_DIM]} over {world} ranks: q is not "
                          "this rank's sequence shard")
    if args.get("is_causal"):
        raise Unsupported("is_causal on a local query block against the gathered keys is top-left aligned, "
                          "not the global causal mask")
    causal = mask is not None
    if causal:
        why = _not_global_causal(mask, q[SEQ_DIM], k[SEQ_DIM], group_name)
        if why:
            return _dense_mask_kv(node, args, mask, (gathers, paths, group_name, world), why)
    shape = AttentionShape(q[0], q[1], k[1], k[SEQ_DIM], q[3])
    inputs = {"q": args["query"], "k": gathers["k"].args[0], "v": gathers["v"].args[0]}
    return AttentionRegion("allgather_kv", node, ATTENTION_OPS[node.target], group_name, world, shape, causal,
                           args.get("scale"), inputs, list(gathers.values()), _output_of(node), paths)


def _dense_mask_kv(node: Node, args: dict, mask: Node, gathered: tuple, why_not_causal: str) -> AttentionRegion:
    """SDPA with a boolean mask of the rank's rows against every key (documents, windows: data
    the graph computes) as a flex_allgather_kv region: the mask a buffer of the flex ops, its
    block tables made from it at run time (commopt.dense_block_tables)."""
    from torch_commopt.kernels.attention.flex import dense_mask_code

    gathers, paths, group_name, world = gathered
    given, mask = mask, boolean_of(mask)
    q, k, m = static_shape(args["query"]), static_shape(args["key"]), static_shape(mask) if mask is not None else ()
    rows, keys = q[SEQ_DIM], k[SEQ_DIM]
    block = DENSE_MASK_BLOCK
    if mask is None:
        raise Unsupported(f"explicit attention mask: {why_not_causal}; and not a boolean mask for the flex path "
                          f"(made by {producers(given)}{fills(given)})")
    if len(m) != 4 or tuple(m[2:]) != (rows, keys) or m[0] not in (1, q[0]) \
            or m[1] not in (1, q[1]) or rows % block or keys % block:
        raise Unsupported(f"explicit attention mask: {why_not_causal}; and not a boolean (B|1, H|1, {rows}, {keys}) "
                          f"mask of whole {block}-token blocks for the flex path (its boolean is {tuple(m)}, "
                          f"made by {producers(given)}{fills(given)})")
    if args.get("dropout_p") or args.get("is_causal"):
        raise Unsupported("explicit attention mask with dropout or is_causal")
    flex_mask = FlexMask([], [mask], dense_mask_code(m[0] == 1, m[1] == 1), [rows, keys, block], dense=True)
    inputs = {"q": args["query"], "k": gathers["k"].args[0], "v": gathers["v"].args[0]}
    scale = args.get("scale") or q[3] ** -0.5
    return AttentionRegion("flex_allgather_kv", node, ATTENTION_OPS[node.target], group_name, world,
                           AttentionShape(q[0], q[1], k[1], keys, q[3]), False, scale, inputs, list(gathers.values()),
                           _output_of(node), paths, flex_mask)


DENSE_MASK_BLOCK = 128  # flex's default block: a dense mask's tiles
DECODE_MAX_QUERIES = 16  # a few new tokens against the cache: decoding, not a sequence shard


def _decode_kv(node: Node, args: dict, gathers: dict, paths: dict, group_name: str, world: int,
               mask: Any) -> AttentionRegion:
    """K and V gathered along the sequence, a few queries that are not a sequence shard: decoding
    over a sequence-sharded KV cache.  The mask, if any, covers the whole cache (its last dim is
    the gathered sequence); each rank takes its columns."""
    q, k = static_shape(args["query"]), static_shape(args["key"])
    if args.get("is_causal"):
        raise Unsupported("is_causal with decoding queries against a gathered cache (top-left aligned, not the cache's)")
    inputs = {"q": args["query"], "k": gathers["k"].args[0], "v": gathers["v"].args[0]}
    if mask is not None:
        m = static_shape(mask)
        if m is None or len(m) > 4 or m[-1] != k[SEQ_DIM]:
            raise Unsupported(f"a decoding mask of shape {m} does not cover the gathered sequence ({k[SEQ_DIM]})")
        inputs["mask"] = mask
    shape = AttentionShape(q[0], q[1], k[1], k[SEQ_DIM], q[3])
    return AttentionRegion("decode_kv", node, ATTENTION_OPS[node.target], group_name, world, shape, False,
                           args.get("scale"), inputs, list(gathers.values()), _output_of(node), paths)


MAX_MASK_NODES, MAX_MASK_ELEMENTS = 64, 1 << 26


def _not_global_causal(mask: Any, s_q: int, s_kv: int, group_name: str) -> Optional[str]:
    """None when `mask` -- computed from constants only -- is this rank's rows of the global
    causal mask (query i of rank r sees key j iff r*S_q + i >= j; boolean, or 0 / -inf
    additive), else why not.  The mask is evaluated at compile time: what the program builds
    from its rank and aranges is checked, not guessed."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from torch_commopt.core.groups import resolve_group

    rank = resolve_group(group_name).rank()
    with unset_fake_temporarily():  # real values: compile passes run under a fake mode
        try:
            value = _evaluate(mask, set())
        except Unsupported as e:
            return str(e)
        return _causal_mismatch(value, s_q, s_kv, rank)


def _causal_mismatch(value: torch.Tensor, s_q: int, s_kv: int, rank: int) -> Optional[str]:
    if value.dim() < 2 or tuple(value.shape[-2:]) != (s_q, s_kv) or value.numel() > MAX_MASK_ELEMENTS:
        return f"shape {list(value.shape)} is not (.., {s_q}, {s_kv})"
    if value.dtype == torch.bool:
        allowed = value
    else:
        allowed = value == 0
        if not bool((allowed | (value == float("-inf"))).all()):
            return "an additive mask with values other than 0 and -inf"
    rows = torch.arange(s_q, device=allowed.device)[:, None] + rank * s_q
    want = rows >= torch.arange(s_kv, device=allowed.device)[None, :]
    if not bool((allowed == want).all()):
        return "not the global causal mask of this rank's query rows"
    return None


def _evaluate(node: Any, seen: set) -> Any:
    """The value of a node computed from constants alone (iota/arange, arithmetic, compare)."""
    if not isinstance(node, Node):
        if isinstance(node, (list, tuple)):
            return type(node)(_evaluate(a, seen) for a in node)
        return node
    if node.op != "call_function" or len(seen) > MAX_MASK_NODES:
        raise Unsupported(f"{node.name} is not computed from constants")
    seen.add(node)
    args = [_evaluate(a, seen) for a in node.args]
    kwargs = {k: _evaluate(v, seen) for k, v in node.kwargs.items()}
    with torch.no_grad():
        return node.target(*args, **kwargs)


def _map_dim(dim: int, origin: Node, path: list[Node]) -> Optional[int]:
    """Where dim `dim` of origin's tensor is after the layout ops of `path` (None: split or merged)."""
    shape = static_shape(origin)
    for op in path:
        out = static_shape(op)
        t = op.target
        if t is aten.permute.default:
            dims = [d % len(shape) for d in op.args[1]]
            dim = dims.index(dim)
        elif t is aten.transpose.int:
            a, b = (d % len(shape) for d in op.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif t is aten.unsqueeze.default:
            dim += op.args[1] % len(out) <= dim
        elif t is aten.squeeze.dim:
            dim -= op.args[1] % len(shape) < dim
        elif shape != out:  # reshape / expand: the dim survives when its size and prefix do
            dim = _reshaped_dim(shape, out, dim)
            if dim is None:
                return None
        shape = out
    return dim


def _reshaped_dim(before: list[int], after: list[int], dim: int) -> Optional[int]:
    prefix = math.prod(before[:dim])
    for j in range(len(after)):
        if math.prod(after[:j]) == prefix and after[j] == before[dim] and math.prod(after[: j + 1]) == prefix * before[dim]:
            return j
    return None


def _output_of(node: Node) -> Node:
    """The attention's output tensor: getitem 0 of the aten ops' tuples, or the node itself."""
    if node.target is aten.scaled_dot_product_attention.default:
        return node
    outs = [u for u in node.users if is_getitem(u) and u.args[1] == 0]
    if len(outs) != 1:
        raise Unsupported(f"{node.name}: its output is not taken exactly once")
    return outs[0]


# ---- ulysses ---------------------------------------------------------------------------------

def _ulysses(node: Node, args: dict, sources: dict) -> AttentionRegion:
    operands = {name: args[name] for name in ("query", "key", "value")}
    return _ulysses_region(node, operands, sources, ATTENTION_OPS[node.target], bool(args.get("is_causal")),
                           args.get("scale"), "ulysses")


def _ulysses_region(node: Node, operands: dict, sources: dict, op: str, causal: bool, scale: Any,
                    form: str) -> AttentionRegion:
    """The region of an attention op (`op`) whose q, k, v (`operands`) come from all-to-alls."""
    a2as, inputs, paths = [], {}, {}
    for name, key in (("query", "q"), ("key", "k"), ("value", "v")):
        origin, paths[f"{key}_post"] = sources[name]
        a2a = origin.args[0]
        if val(a2a).numel() != val(operands[name]).numel():
            raise Unsupported(f"{name}: the ops between the all-to-all and the attention change its size")
        a2as.append(a2a)
        inputs[key], paths[f"{key}_pre"] = trace_back(a2a.args[0])
    out_a2a, paths["out"] = _drain_all_to_all(_output_of(node))
    groups = {(group_name_of(n.args[3]), equal_parts(n)) for n in a2as + [out_a2a]}
    if len(groups) != 1 or None in next(iter(groups)):
        raise Unsupported(f"the four all-to-alls differ in group or are split unevenly: {sorted(map(str, groups))}")
    (group_name, world), = groups
    q, k = static_shape(operands["query"]), static_shape(operands["key"])
    if q[SEQ_DIM] != k[SEQ_DIM]:
        raise Unsupported(f"after the all-to-all q holds {q[SEQ_DIM]} positions and k {k[SEQ_DIM]}: not the full sequence")
    shape = AttentionShape(q[0], q[1] * world, k[1] * world, q[SEQ_DIM], q[3])
    return AttentionRegion(form, node, op, group_name, world, shape, causal, scale, inputs, a2as + [out_a2a],
                           only_user(out_a2a), paths)


def _drain_all_to_all(out: Node) -> tuple[Node, list[Node]]:
    """The all_to_all_single the attention output reaches through layout ops used once (a
    forward graph may also return the output, saved for the backward, and a joint graph's
    attention backward reads it: those uses are allowed), and those layout ops in order."""
    node, path = out, []
    backward = set(ATTENTION_BACKWARD.values()) | {FLEX_BACKWARD}
    while True:
        users = [u for u in node.users if not _only_returned(u) and not (node is out and u.target in backward)]
        if len(users) != 1:
            raise Unsupported(f"the attention output {out.name} has {len(users)} users before any all-to-all")
        user = users[0]
        if user.target is ALL_TO_ALL:
            if only_user(user) is None or only_user(user).target is not WAIT:
                raise Unsupported(f"{user.name} is not waited on by exactly one wait_tensor")
            return user, path
        if user.op != "call_function" or user.target not in LAYOUT_OPS:
            raise Unsupported(f"the attention output goes through {user.target}, not an all-to-all")
        node = user
        path.append(user)


def _only_returned(node: Node) -> bool:
    """True for the graph output, or layout ops whose values only reach it (a forward graph
    returning a tensor, or an alias of it, that the backward saves)."""
    if node.op == "output":
        return True
    return node.target in LAYOUT_OPS and all(_only_returned(u) for u in node.users)
