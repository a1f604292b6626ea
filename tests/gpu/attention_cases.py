"""Per-rank programs: context-parallel attention on NCCL with the CUDA local kernels (cuDNN,
the Triton LSE merge), every schedule against full attention on one device.

Every rank draws the same global q, k, v, dout (bf16, fresh per case) and keeps its shard
(contiguous, or zigzag: chunks r and 2W-1-r), so the truth is computed locally: SDPA on the
whole sequence in float32 (autograd for the gradients).  A schedule passes when its error is
within the tolerance of eager bf16 SDPA's own error against that truth (validate.within_tolerance).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_commopt  # noqa: F401  (registers the ops)
from torch_commopt.core.attention_spec import refusal
from torch_commopt.kernels.attention.ops import CPOptions, cp_attention
from torch_commopt.testing.validate import rel_err

# (B, H, H_kv, S_loc, D, causal)
SHAPES = [(2, 8, 8, 512, 128, True), (1, 8, 2, 1000, 64, True), (1, 8, 2, 768, 128, False), (2, 4, 1, 256, 128, True)]
SCHEDULES = ["allgather", "ring", "ring_zigzag", "ulysses", "ulysses:early"]
BIG = (1, 32, 8, 8192, 128, True)  # large enough for ring_zigzag's and ulysses's head groups on their own


def _truth(q, k, v, dout, causal):
    """fp32 attention and its gradients, one K/V head (and its query heads) at a time: fp32
    SDPA takes the math path, whose score matrix for all heads of a 16K sequence (B1 H32)
    would be 32 GiB."""
    g = q.shape[1] // k.shape[1]
    parts = []
    for j in range(k.shape[1]):
        qj, kj, vj = (t.detach().float().requires_grad_(True)
                      for t in (q[:, j * g:(j + 1) * g], k[:, j:j + 1], v[:, j:j + 1]))
        out = F.scaled_dot_product_attention(qj, kj, vj, is_causal=causal, enable_gqa=True)
        parts.append((out.detach(),) + torch.autograd.grad(out, (qj, kj, vj), dout[:, j * g:(j + 1) * g].float()))
    return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(4))


def _eager(q, k, v, dout, causal):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)


def _chunks(rank: int, world: int, layout: str) -> list[int]:
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _shard(t: torch.Tensor, rank: int, world: int, layout: str) -> torch.Tensor:
    n = 1 if layout == "contiguous" else 2
    pieces = t.chunk(n * world, dim=2)
    return torch.cat([pieces[c] for c in _chunks(rank, world, layout)], dim=2).contiguous()


def _unshard(t: torch.Tensor, world: int, layout: str) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous())
    n = 1 if layout == "contiguous" else 2
    c = t.shape[2] // n
    chunks = [None] * (n * world)
    for r, part in enumerate(parts):
        for j, ch in enumerate(_chunks(r, world, layout)):
            chunks[ch] = part[:, :, j * c:(j + 1) * c]
    return torch.cat(chunks, dim=2)


def _case(rank, world, shape, schedule, layout, seed, head_groups=None, device="cuda"):
    b, h, h_kv, s_loc, d, causal = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *sz: torch.randn(*sz, device=device, generator=gen).bfloat16()  # noqa: E731
    s = s_loc * world
    q, dout = mk(b, h, s, d), mk(b, h, s, d)
    k, v = mk(b, h_kv, s, d), mk(b, h_kv, s, d)
    truth, eager = _truth(q, k, v, dout, causal), _eager(q, k, v, dout, causal)
    leaves = [_shard(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
    if head_groups is None:
        out = cp_attention(*leaves, schedule=schedule, causal=causal, options=CPOptions(layout=layout))
    else:  # the schedules' own entry: the pipeline depth forced
        from torch_commopt.kernels.attention import schedules

        kw = dict(schedule=schedule, causal=causal)
        shards = [t.detach() for t in leaves]
        dout_l = _shard(dout, rank, world, layout)
        grouped = CPOptions(head_groups=head_groups)
        out_, lse = schedules.cp_attention_fwd(*shards, options=grouped, **kw)
        runs = [("plain", out_, schedules.cp_attention_bwd(dout_l, (*shards, out_, lse), options=grouped, **kw))]
        # the training form: q, k, v, out, lse kept where the attention ran, dout alone moved
        out_k, kept = schedules.cp_attention_fwd_keep(*shards, options=grouped, **kw)
        runs.append(("kept", out_k, schedules.cp_attention_bwd_kept(dout_l, kept, **kw)))
        results = []
        for form, o, grads in runs:
            got = [_unshard(x, world, layout) for x in (o, *grads)]
            results += [(f"{shape} {schedule} groups={head_groups} {form} {n}", rel_err(x, t), rel_err(e, t))
                        for n, x, t, e in zip(("out", "dq", "dk", "dv"), got, truth, eager)]
        return results
    out.backward(_shard(dout, rank, world, layout))
    got = [_unshard(x, world, layout) for x in (out, *(t.grad for t in leaves))]
    return [(f"{shape} {schedule} {layout} {n}", rel_err(x, t), rel_err(e, t))
            for n, x, t, e in zip(("out", "dq", "dk", "dv"), got, truth, eager)]


def run_cp_attention_cases(rank: int, world: int, device: str = "cuda") -> list[tuple[str, float, float]]:
    """[(label, error, eager bf16's error)] for every accepted schedule x shape (contiguous
    program; through cp_attention's autograd, i.e. the kept training form for ulysses and
    ring_zigzag), ring_zigzag on zigzag shards, two head groups forced (the plain and the kept
    forms), and one large shard whose size makes ring_zigzag and ulysses pipeline on their own
    (CUDA only; device="cpu" checks the harness on gloo)."""
    results, seed = [], 0
    schedules = SCHEDULES + (["hybrid:2:2"] if world == 4 else [])
    for shape in SHAPES:
        b, h, h_kv, s_loc, d, causal = shape
        for schedule in schedules:
            if refusal(schedule, (b, h, h_kv, s_loc * world, d), world, causal) is None:
                seed += 1
                results += _case(rank, world, shape, schedule, "contiguous", seed, device=device)
        if causal and s_loc % 2 == 0:
            seed += 1
            results += _case(rank, world, shape, "ring_zigzag", "zigzag", seed, device=device)
            if h_kv % 2 == 0:
                seed += 1
                results += _case(rank, world, shape, "ring_zigzag", "contiguous", seed, head_groups=2, device=device)
        if h_kv % (2 * world) == 0:  # ulysses's all-to-alls over two head groups
            for schedule in ("ulysses", "ulysses:early"):
                seed += 1
                results += _case(rank, world, shape, schedule, "contiguous", seed, head_groups=2, device=device)
    # pipelined on their own over 2 head groups: ring_zigzag and ulysses (at world 2: at 4 the
    # fp32 truth over BIG's 32K tokens would take ~50 GiB per rank)
    if device == "cuda" and world == 2:
        results += _case(rank, world, BIG, "ring_zigzag", "contiguous", seed + 1)
        results += _case(rank, world, BIG, "ulysses", "contiguous", seed + 2)
        results += _case(rank, world, BIG, "ulysses:early", "contiguous", seed + 3)
    return results


def tune_attention(rank: int, world: int, cache_dir: str):
    """attention.tune.measure_and_store on the GPUs (forward + backward, causal GQA, bf16):
    (winner, {schedule: ms}) of this rank."""
    from torch_commopt.core.attention_spec import AttentionShape
    from torch_commopt.tuner.attention.tune import measure_and_store

    return measure_and_store(AttentionShape(1, 8, 4, 4096, 64), True, torch.bfloat16, True, cache_dir=cache_dir,
                             top_k=2)


def run_a2a_buffer_growth(rank: int, world: int, busy_ms: float = 0.0) -> list[tuple[str, bool, int]]:
    """Ulysses's training forward (cp_attention_fwd_keep, one head group: everything in one
    all-to-all) by the copy engine against the same call on NCCL's all-to-alls, on a fresh group
    whose buffer starts at 512 MiB and grows to 1 GiB at the second shape, as bench_attention's
    sequence did when one such call came back wrong (2x H100: 0.6 off at B1 H32/32
    S32768).  Both run the same local attention on the same inputs, so out and every kept tensor
    must agree bit for bit.  busy_ms: each copy-engine call queued behind that much GPU work
    (a spin), so the buffer grows while the GPU is busy -- bench_attention's condition (the
    single-GPU reference runs right before its first check), under which the wrong call was
    reproduced before symm.GroupRuntime._settle.  [(label, equal, the copy-engine buffers'
    MiB)] per call."""
    import os

    from torch_commopt.kernels.attention import ce_a2a
    from torch_commopt.kernels.attention.schedules import cp_attention_fwd_keep
    from torch_commopt.kernels.gpu import symm

    group = dist.new_group(list(range(world)))
    results = []
    for i, (h, h_kv, s_total) in enumerate([(32, 32, 16384), (32, 32, 32768), (32, 8, 32768), (32, 32, 16384)]):
        gen = torch.Generator(device="cuda").manual_seed(100 + i * world + rank)
        mk = lambda heads: torch.randn(1, heads, s_total // world, 128, device="cuda",  # noqa: E731
                                       generator=gen).bfloat16()
        q, k, v = mk(h), mk(h_kv), mk(h_kv)
        runs = {}
        for transport in ("ce", "nccl"):
            os.environ[ce_a2a.ENV] = transport
            if busy_ms and transport == "ce":
                torch.cuda._sleep(int(busy_ms * 1.5e6))  # ~1.5 GHz: cycles per ms, roughly
            out, kept = cp_attention_fwd_keep(q, k, v, schedule="ulysses:g=1", causal=True, group=group,
                                              options=CPOptions(head_groups=1))
            torch.cuda.synchronize()
            runs[transport] = [out.clone()] + [t.clone() for t in kept]
        os.environ.pop(ce_a2a.ENV)
        rt = symm.existing(group.group_name, q.device)
        mib = max((b.nbytes >> 20 for b in rt.owned.get(ce_a2a.PURPOSE, [])), default=0) if rt is not None else 0
        same = all(torch.equal(a, b) for a, b in zip(runs["ce"], runs["nccl"]))
        results.append((f"H{h}/{h_kv} S{s_total}", same, mib))
    return results
