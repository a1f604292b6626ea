"""`python -m torch_commopt tune`: fill the tuner cache before training starts.

For region shapes (`KIND:ROWSxKxN[,N2...]`, the local A of the op as in `explain`; collective
dim 0, no bias, sum) every rank times the same candidates the compile pass would (the model's
top-k and sequential, tuner.autotune.plan) and rank 0 stores the winner under the key the
pass asks for, so `Config.mode="autotune"` then compiles with no timing at all.  For
context-parallel attention shapes (`B,H,HKV,S,D[:causal][:train]`, the global q/k/v, forward
or forward + backward) the same is done by tuner/attention/tune.py, whose answer the attention
rewrite takes.  `--model demo` instead runs the demo's TP+SP block with mode="autotune" once
(its first call times and caches every region).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from torch_commopt.kernels.matmul.ops import runner
from torch_commopt.kernels.matmul.reference.chunking import chunk_rows

log = logging.getLogger("torch_commopt.tuner.tune")
KINDS = ("ag_matmul", "matmul_rs", "matmul_ar")


def parse_shape(spec: str) -> tuple[str, list[int], list[list[int]]]:
    """"KIND:ROWSxKxN[,N2...]" -> (kind, local A shape, weight shapes)."""
    kind, _, dims = spec.partition(":")
    try:
        rows, k, ns = dims.split("x")
        a_shape, widths = [int(rows), int(k)], [int(n) for n in ns.split(",")]
    except ValueError as e:
        raise ValueError(f"commopt tune: bad --shape {spec!r} (want KIND:ROWSxKxN[,N2...]): {e}") from e
    if kind not in KINDS:
        raise ValueError(f"commopt tune: unknown kind {kind!r} in {spec!r}; known: {KINDS}")
    if kind != "ag_matmul" and len(widths) != 1:
        raise ValueError(f"commopt tune: {kind} takes one weight, got {spec!r}")
    return kind, a_shape, [[a_shape[1], n] for n in widths]


def tune_this_rank(rank: int, world: int, specs: list[str], dtype_name: str, cache_dir: str | None, top_k: int,
                 graphs: bool = False, attention: tuple[str, ...] = ()):
    from torch_commopt.tuner.cache import TunerCache
    from torch_commopt.tuner.gemm_table import with_gemms
    from torch_commopt.tuner.machine import calibration_for, device_name
    from torch_commopt.tuner.matmul.autotune import MODEL_TIE, Timing, measure_candidates, plan, winner
    from torch_commopt.tuner.matmul.model import RegionFacts

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    group_name = dist.group.WORLD.group_name
    dtype = getattr(torch, dtype_name)
    cal = calibration_for(device, world, group_name, cache_dir, 300.0)
    out = []
    for spec in specs:
        kind, a_shape, w_shapes = parse_shape(spec)
        dim, reduce_op = (0, None) if kind == "ag_matmul" else (None if kind == "matmul_ar" else 0, "sum")
        def gemms(shape, pool, g):
            return with_gemms(cal, shape, pool, device, group_name, cache_dir, 300.0, graphs=g)

        facts = RegionFacts(kind, a_shape, w_shapes, dim, world, dtype_name, reduce_op=reduce_op)
        pick, _, top, key, _ = plan(facts, device_name(device), cal,
                                    chunk_rows(kind, a_shape, [a_shape[0], w_shapes[0][1]], dim, world, 8), top_k,
                                    graphs, gemms=gemms)
        a = torch.randn(a_shape, device=device, dtype=dtype)
        ws = [torch.randn(s, device=device, dtype=dtype) / s[0] ** 0.5 for s in w_shapes]
        measured = measure_candidates(runner(kind, a, ws, world, group_name), top, group_name, device, spec,
                                      timing=Timing(graphs=graphs))
        best = winner(measured, prior=str(pick), tie=MODEL_TIE)  # as the compile pass's autotune decides
        if rank == 0:
            TunerCache(cache_dir).put(key, {"schedule": best, "measured_ms": measured})
        out.append((spec, best, measured))
    if attention:
        from torch_commopt.tuner.attention.tune import measure_and_store, parse_spec

        for spec in attention:
            shape, causal, backward = parse_spec(spec)
            best, measured = measure_and_store(shape, causal, dtype, backward, group=group_name, cache_dir=cache_dir,
                                               top_k=top_k)
            out.append((f"attention {spec}", best, measured))
    return out
