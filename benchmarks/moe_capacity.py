"""bench_moe --capacity: a fixed-capacity MoE layer compiled whole, Inductor against commopt's
chunked exchanges (passes/moe/capacity.py) on the graph's own NCCL collectives.

The layer is torch_commopt.testing.models.CapacityMoE (top-1, GShard-style one-hot dispatch and
combine, SwiGLU experts as batched GEMMs), capacity 1.25x the balanced share, at the
DeepSeek-V2-Lite- and Mixtral-like experts' shapes.  Variants, in alternating order each round,
each the layer under torch.compile fwd+bwd in bf16:
- `inductor`: the default backend (the baseline of these rows' ×);
- `commopt a2a`: commopt, the exchanges kept (what Config.moe_schedule "a2a" does);
- `commopt by_expert:C`: the exchanges in C chunks of experts, forced;
- `commopt auto`: the cost model's pick.
The cases share bench_moe's JSON form, so `bench_moe --join` puts them in the MoE report.
"""

from __future__ import annotations

import copy
import statistics
import time

from benchmarks.common import max_over_ranks

CAPACITY_MODELS = {  # (dim, expert hidden, experts)
    "capacity dsv2-lite": (2048, 1408, 64),
    "capacity mixtral-8x7b": (4096, 14336, 8),
}
CAPACITY_VARIANTS = ("inductor", "commopt a2a", "commopt by_expert:2", "commopt by_expert:4", "commopt auto")


def capacity_rank(rank: int, world: int, models: dict, tokens_list: list, rounds: int, steps: int):
    import torch
    import torch.distributed as dist

    import torch_commopt
    from torch_commopt.testing.models import CapacityMoE

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = dist.group.WORLD.group_name
    out = []
    for name, (dim, hidden, experts) in models.items():
        for tokens in tokens_list:
            capacity = -(-tokens * 5 // (4 * experts))  # 1.25x the balanced share
            torch.manual_seed(0)
            torch._dynamo.reset()  # a case's five compiles of one forward stay inside dynamo's cache limit
            base = CapacityMoE(dim, hidden, experts, world, capacity, group).to(device, torch.bfloat16)
            layers = {}
            for v in CAPACITY_VARIANTS:  # a copy each: one module's compiled code is never another backend's
                layer = copy.deepcopy(base)
                layers[v] = torch.compile(layer) if v == "inductor" else torch.compile(
                    layer, backend="commopt", options={"moe_schedule": v.split()[1]})
            g = torch.Generator(device=device).manual_seed(100 + rank)
            x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
            dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=g)
            ref, errors, times, notes = None, {}, {v: [] for v in CAPACITY_VARIANTS}, {}
            for v, layer in layers.items():  # warm-up (compiles), outputs and x's gradient compared
                x.grad = None
                torch_commopt.reset_explain()
                y = layer(x)
                y.backward(dy)
                notes[v] = [n for g in torch_commopt.explain().graphs for n in g.notes if n.startswith("moe ")]
                got = (y.detach().float(), x.grad.float())
                ref = got if ref is None else ref
                errors[v] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
            for r in range(rounds):
                for v in (CAPACITY_VARIANTS if r % 2 == 0 else CAPACITY_VARIANTS[::-1]):
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        layers[v](x).backward(dy)
                    torch.cuda.synchronize()
                    times[v].append((time.perf_counter() - t0) / steps * 1e3)
            med = max_over_ranks([statistics.median(times[v]) for v in CAPACITY_VARIANTS], device)
            err = max_over_ranks([errors[v] for v in CAPACITY_VARIANTS], device)
            out.append({"model": name, "shape": {"dim": dim, "expert_ffn": hidden, "experts": experts, "top_k": 1,
                                                 "capacity": capacity},
                        "tokens_per_rank": tokens, "routing": "top-1, capacity 1.25", "raw_ms": times,
                        "ms": dict(zip(CAPACITY_VARIANTS, med)), "max_rel_error": dict(zip(CAPACITY_VARIANTS, err)),
                        "moe_notes": notes})
            if rank == 0:
                print(f"{name} T={tokens}: " + ", ".join(f"{v} {t:.2f}" for v, t in out[-1]["ms"].items()) + " ms",
                      flush=True)
                for v, said in notes.items():
                    print(f"  {v}: " + " | ".join(said), flush=True)
    return out, torch.cuda.get_device_name(device)
