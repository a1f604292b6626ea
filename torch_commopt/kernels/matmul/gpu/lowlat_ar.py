"""matmul + all-reduce for decode-sized calls: `oneshot` / `twoshot`, the product computed straight
into this rank's slot of the low-latency buffer, then the one-shot / two-shot all-reduce kernel
(kernels/gpu/lowlat.py).
Two launches a call (cuBLAS, then the kernel), no copy of the partial; every rank gets the same
bits as the reference, Schedule gather_sum / scatter_gather (fp32 sums in rank order).  Any row count runs: no row
splits over the ranks, every rank sums every element of its own output."""

from __future__ import annotations

import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.gpu import lowlat, symm
from torch_commopt.kernels.matmul.product import Product

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def refusal(a, weight, world: int, group_name: str, capturing: bool, sc) -> str | None:
    """Why this call cannot run `oneshot` or `twoshot` (None: it can)."""
    if weight.dim() != 2:
        return "batched (3-D) weight"
    if sc is not None:
        return "oneshot has no scaled (float8) product yet"
    if a.dtype not in DTYPES or weight.dtype != a.dtype:
        return f"oneshot takes bf16/fp16/fp32 of one dtype, got {a.dtype} and {weight.dtype}"
    if world > symm.MAX_WORLD:
        return f"more than {symm.MAX_WORLD} ranks"
    rows = a.numel() // max(1, a.shape[-1])
    if not lowlat.LowLatency.fits(rows * weight.shape[-1], a.dtype):
        return f"a {rows} x {weight.shape[-1]} product exceeds the {lowlat.LL_CAP_BYTES >> 20} MiB low-latency buffer"
    if capturing:
        rt = symm.existing(group_name, a.device)
        if rt is None or not rt.has_own_buffer(lowlat.PURPOSE, lowlat.LL_CAP_BYTES):
            return "CUDA-graph capture before the low-latency buffer exists (run the call once outside the graph first)"
    return None


def matmul_ar_lowlat(prod: Product, reduce_op: str, group_name: str, sched: Schedule) -> torch.Tensor:
    """t = a @ weight (+ bias) (+ the K parts' products), all-reduced by the one-shot or two-shot
    kernel (sched.name)."""
    a, weight, bias = prod.a, prod.weight, prod.bias
    ll = lowlat.for_runtime(symm.runtime(group_name, a.device))
    rows, n = a.numel() // a.shape[-1], weight.shape[-1]
    slot = ll.slot((rows, n), a.dtype)
    a2 = a.reshape(rows, a.shape[-1])
    if bias is None:
        torch.mm(a2, weight, out=slot)
    else:
        torch.addmm(bias, a2, weight, out=slot)
    for x, w in prod.parts:
        slot.addmm_(x.reshape(rows, x.shape[-1]), w)
    out = a.new_empty(list(a.shape[:-1]) + [n])
    return ll.all_reduce(out, reduce_op, debug=symm.debug_waits(sched), two_shot=sched.name == "twoshot")
