"""How an attention mask argument was made, read back from the graph: SDPA's additive forms of a
boolean mask (where(mask, 0, fill), where(~mask, fill, 0)) to the boolean, and what a refusal names
of a form it cannot read (the producing ops, the where's values)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import Node

from torch_commopt.passes.graph_utils import aten, val

_FITTED = (aten.expand.default, aten._to_copy.default, aten.clone.default)  # a bias made to fit


# What SDPA fills a boolean mask's masked scores with when it makes the mask additive for a
# kernel that takes a float bias: -inf before flash/efficient, a large finite negative before cuDNN
# (ATen's convert_boolean_attn_mask_cudnn, its workaround for cuDNN's handling of -inf: -65504, the
# fp16 minimum, in some releases; the dtype's lowest value or another constant in others, and
# where(mask, 0, fill) or where(~mask, fill, 0) by release).  Any fill at or below -65504 leaves a
# masked score no weight beside an unmasked one (exp of it underflows in every float dtype), so it
# means "masked" in the program's own terms: the boolean it was given.  A row with no allowed key
# is where the forms differ: a finite fill leaves it attention over every key (or V's plain
# average, where the fill swamps the scores' differences in rounding), -inf and flex give it 0.
# The boolean's own meaning is read, as SDPA's math and flash paths state it (0 since torch 2.5).
MASKED_FILL_AT_MOST = -65504.0


def masks_out(fill: Any) -> bool:
    """Whether a where() fill is a boolean mask's "masked" value (MASKED_FILL_AT_MOST)."""
    return isinstance(fill, (int, float)) and not isinstance(fill, bool) and fill <= MASKED_FILL_AT_MOST


def boolean_of(mask: Node) -> Optional[Node]:
    """The boolean mask SDPA's mask argument is: itself, or the condition of where(cond, 0, fill)
    or where(~cond, fill, 0) with a masking fill (masks_out: how SDPA makes a boolean mask additive
    before a kernel that takes a float bias); None else."""
    if val(mask).dtype == torch.bool:
        return mask
    while mask.target in _FITTED:
        mask = mask.args[0]
    if mask.target is not aten.where.self or not isinstance(mask.args[0], Node) or val(mask.args[0]).dtype != torch.bool:
        return None
    cond, values = mask.args[0], [constant(a) for a in mask.args[1:]]
    if values[0] == 0.0 and masks_out(values[1]):
        return cond
    if values[1] == 0.0 and masks_out(values[0]) and cond.target in (aten.logical_not.default,
                                                                      aten.bitwise_not.default):  # where(~mask, fill, 0)
        return cond.args[0]
    return None


def fills(mask: Any) -> str:
    """A where()'s two values as a refusal names them (empty for anything else)."""
    while isinstance(mask, Node) and mask.target in _FITTED:
        mask = mask.args[0]
    if not isinstance(mask, Node) or mask.target is not aten.where.self:
        return ""
    values = [constant(a) for a in mask.args[1:]]
    shown = [getattr(v.target, "__name__", str(v.target)) if isinstance(v, Node) else repr(v) for v in values]
    return f"; where's values {', '.join(map(str, shown))}"


def producers(node: Any, depth: int = 4) -> str:
    """The ops that made `node`, nearest first, a few deep: what a refusal of its form names."""
    names = []
    while isinstance(node, Node) and node.op == "call_function" and len(names) < depth:
        names.append(getattr(node.target, "__name__", str(node.target)))
        node = next((a for a in node.args if isinstance(a, Node)), None)
    return " <- ".join(names) or "an input"


def constant(arg: Any) -> Any:
    """A number, or the value of what makes one: full / scalar_tensor, or a 0-d tensor constant of
    the graph's module (get_attr, through lift_fresh_copy); else the argument itself."""
    if not isinstance(arg, Node):
        return arg
    if arg.target is aten.full.default:
        return arg.args[1]
    if arg.target is aten.scalar_tensor.default:
        return arg.args[0]
    if arg.target is aten.lift_fresh_copy.default and isinstance(arg.args[0], Node):
        arg = arg.args[0]
    if arg.op == "get_attr":
        value = getattr(arg.graph.owning_module, arg.target, None)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
            return value.item()
    return arg
