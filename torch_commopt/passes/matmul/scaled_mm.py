"""torch._scaled_mm (float8) matmuls in a region: their operands, and the forms commopt runs.

The ops run a region's float8 matmuls piece by piece (kernels/scaled.py), which holds for
tensor-wise scales: one fp32 number for A and one for B.  Row-wise scales, a float8 output
(scale_result) or no output dtype leave the region untouched, with the reason.  A float8
shard gathered as uint8 and viewed back (what gloo, which has no float8 type, and PyTorch's
own float8 async-TP tests do) is the same all-gather: the finder looks through the view.
"""

from __future__ import annotations

import math

from torch.fx import Node

from torch_commopt.kernels.scaled import FP8
from torch_commopt.passes.graph_utils import VIEW_DTYPE, Unsupported, static_shape, val
from torch_commopt.passes.regions import ScaledArgs

_ARGS = ("self", "mat2", "scale_a", "scale_b", "bias", "scale_result", "out_dtype", "use_fast_accum")


def scaled_operands(mm: Node) -> tuple[Node, Node, Node | None, ScaledArgs]:
    """(A, B, bias, the float8 arguments) of a _scaled_mm node; Unsupported for a form the ops
    do not run."""
    args = dict(zip(_ARGS, mm.args)) | dict(mm.kwargs)
    if args.get("scale_result") is not None:
        raise Unsupported(f"_scaled_mm {mm.name} has a scale_result (a float8 output)")
    out_dtype = args.get("out_dtype")
    if out_dtype is None or out_dtype in FP8:
        raise Unsupported(f"_scaled_mm {mm.name} has out_dtype {out_dtype} (commopt runs bf16/fp16/fp32 outputs)")
    for name in ("scale_a", "scale_b"):
        shape = static_shape(args[name])
        if math.prod(shape) != 1:
            raise Unsupported(f"_scaled_mm {mm.name} has a {name} of shape {shape}: only tensor-wise scales are "
                              "supported (row-wise ones would travel with the rows they scale)")
    bias = args.get("bias")
    if bias is not None and static_shape(bias) != [static_shape(args["mat2"])[-1]]:
        raise Unsupported(f"_scaled_mm {mm.name} bias is not a vector over the output columns")
    return args["self"], args["mat2"], bias, ScaledArgs(args["scale_a"], args["scale_b"], out_dtype,
                                                        bool(args.get("use_fast_accum", False)))


def float8_view(node: Node):
    """(the view node, its float8 dtype) if `node`'s only use views its bytes as float8."""
    users = list(node.users)
    if len(users) != 1 or users[0].target is not VIEW_DTYPE or users[0].args[1] not in FP8:
        return None
    v = val(node)
    if v is None or v.dtype.itemsize != 1:
        return None
    return users[0], users[0].args[1]


def check_consumers(consumers) -> None:
    """One region's float8 matmuls run as one op: one A scale, output dtype and accumulation
    mode.  (A gathered tensor's matmuls are all float8 or all plain: torch has no plain
    float8 mm.)"""
    if consumers[0].scaled is None:
        return
    if len({(c.scaled.a_scale, c.scaled.out_dtype, c.scaled.fast_accum) for c in consumers}) > 1:
        raise Unsupported("float8 matmuls of one all-gather with different A scales, output dtypes or accumulation")
