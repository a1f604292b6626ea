"""A mask stated over a layout's positions, with the gathers through the positions folded.

`Layout.mask_mod(mask_mod)` states a mask of sequence positions over layout positions:
mask_mod(b, h, pos[q], pos[kv]).  A document mask then reads ids[pos[q]]: two dependent loads
a score the kernel evaluates, where the same mask over the layout's own document ids,
(ids[pos])[q], takes one.  On one H200, over `by_work`'s rows at W = 2 (1K and 4K documents,
16K-32K tokens), the busiest rank's fwd+bwd took 3-4% less time in commopt's kernels
(flex.block_forward / block_backward) with the mask in the second form, 6-9% less in
torch.compile's flex_attention; the outputs and gradients were bit-equal.

`over_positions` traces the composed mask once (flex.lift: aten ops, the tensors it reads as
buffers), replaces every buf[pos[x]] by a gather from buf[pos], computed here, and returns the
mask as a plain function over those tensors (what flex.lifted_mask keys its traces by), its
trace handed to lifted_mask so that the schedules do not trace it again.  The tensors are read
now: like the block tables built from the mask, the folded mask describes the buffers as they
are when it is made.  A mask it cannot trace or fold is returned composed as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)
_INDEX = torch.ops.aten.index.Tensor


def over_positions(mask_mod: Callable, pos: Tensor) -> Callable:
    """mask_mod(b, h, pos[q], pos[kv]), its gathers through pos folded where it reads a tensor at a
    position (module docstring)."""
    def composed(b, h, q, kv):
        return mask_mod(b, h, pos[q], pos[kv])

    from torch_commopt.kernels.attention import flex

    try:
        gm, buffers = flex.lift(composed, pos.device)
    except Exception as e:  # noqa: BLE001  (any mask make_fx cannot trace keeps its composed form)
        log.debug("commopt flex: the layout's mask is not traceable (%s); its gathers stay composed", e)
        return composed
    folded = _fold(gm, list(buffers), pos)
    if folded is None:
        return composed
    forward = flex.mask_from_code(gm.code)._forward  # noqa: SLF001  (a plain function: lifted_mask keys by it)

    def mask(b, h, q, kv, _forward=forward, _buffers=tuple(folded)):
        return _forward(None, b, h, q, kv, *_buffers)

    flex.remember_lift(mask, pos.device, (gm, tuple(folded)))  # the schedules' lift of it: this trace
    return mask


def _fold(gm: torch.fx.GraphModule, buffers: list, pos: Tensor) -> list | None:
    """Rewrite gm (b, h, q, kv, *buffers) in place: each buf[pos[x]] becomes a gather from a new
    buffer buf[pos]; placeholders left unread are dropped.  Returns the buffers gm then takes, or
    None where nothing was folded (gm is then unchanged)."""
    graph = gm.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    buffer_ph = places[4:]  # after b, h, q, kv
    at_pos = {n for n, t in zip(buffer_ph, buffers) if t is pos}
    made: dict[tuple, torch.fx.Node] = {}
    last, changed = places[-1], False
    for node in list(graph.nodes):
        inner = _gather_of(node)
        if inner is None or inner[0] not in buffer_ph or inner[0] in at_pos:
            continue
        through = _gather_of(inner[1])
        if through is None or through[0] not in at_pos:
            continue
        src = buffers[buffer_ph.index(inner[0])]
        if src.dim() < 1 or src.shape[0] < pos.numel():  # pos: a permutation of range(len(pos))
            continue
        key = (inner[0], through[0])
        if key not in made:
            with graph.inserting_after(last):
                last = made[key] = graph.placeholder(f"folded{len(made)}")
            buffers.append(src[pos])
            buffer_ph.append(last)
        with graph.inserting_before(node):
            node.replace_all_uses_with(graph.call_function(_INDEX, (made[key], [through[1]])))
        graph.erase_node(node)
        changed = True
    if not changed:
        return None
    graph.eliminate_dead_code()
    kept = [t for n, t in zip(buffer_ph, buffers) if n.users]
    for n in buffer_ph:
        if not n.users:
            graph.erase_node(n)
    gm.recompile()
    return kept


def _gather_of(node) -> tuple | None:
    """(source, index) of a node that is aten.index.Tensor(source, [index]), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not _INDEX:
        return None
    src, indices = node.args[0], node.args[1]
    if len(indices) != 1 or indices[0] is None:
        return None
    return src, indices[0]
