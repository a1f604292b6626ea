"""Per-rank programs for the distributed decoding attention on GPUs (kernels/attention/decode.py,
decode_triton.py): every rank builds the whole cache from seeds, so each checks its result against
attention over the whole cache (local_partial in fp32 on every key) without another collective."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from torch_commopt.kernels.attention.decode import local_partial


def _own_error(truth: torch.Tensor, dtype: torch.dtype) -> float:
    """The reference's own error in `dtype`: its fp32 result rounded to it."""
    return float((truth.to(dtype).float() - truth).abs().max()) if dtype != torch.float32 else 1e-6


# (B, H, H_kv, S_q, S_loc, D, dtype, mask): a Llama-3-8B decode step's share (TP heads: 32 / 8 per
# rank at TP 1), GQA 4:1, 8:1 and 1:1, prefix and random bool masks, an additive one, fp32
SPLIT_KV_CASES = [(8, 32, 8, 1, 16384, 128, torch.bfloat16, None), (2, 32, 8, 4, 4100, 128, torch.bfloat16, "prefix"),
                  (1, 8, 8, 16, 1000, 64, torch.float16, "additive"), (2, 4, 1, 2, 3000, 128, torch.float32, "random"),
                  (4, 64, 8, 1, 33000, 128, torch.bfloat16, "prefix")]


def _mask(kind, b, sq, s, device, gen):
    if kind == "prefix":  # each batch row's valid length, one of them attending nothing
        lengths = torch.randint(1, s, (b,), generator=gen, device=device)
        lengths[-1] = 0
        return (torch.arange(s, device=device) < lengths[:, None]).view(b, 1, 1, s)
    if kind == "random":
        return torch.rand(b, 1, sq, s, generator=gen, device=device) > 0.5
    if kind == "additive":
        return torch.randn(b, 1, 1, s, generator=gen, device=device)
    return None


def check_split_kv(device: torch.device) -> list[str]:
    """decode_triton.partial against local_partial on every SPLIT_KV_CASES case; [failures]."""
    from torch_commopt.kernels.attention import decode_triton

    bad = []
    for i, (b, h, hkv, sq, s, d, dtype, kind) in enumerate(SPLIT_KV_CASES):
        gen = torch.Generator(device=device).manual_seed(i)
        q = torch.randn(b, h, sq, d, generator=gen, device=device).to(dtype)
        k = torch.randn(b, hkv, s, d, generator=gen, device=device).to(dtype)
        v = torch.randn(b, hkv, s, d, generator=gen, device=device).to(dtype)
        mask = _mask(kind, b, sq, s, device, gen)
        scale = 1 / math.sqrt(d)
        out, lse = decode_triton.partial(q, k, v, mask, scale)
        ref_out, ref_lse = local_partial(q, k, v, mask, scale)
        if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) or out[torch.isneginf(ref_lse)].any():
            bad.append(f"case {i}: the rows with no key differ")
            continue
        fin = ~torch.isneginf(ref_lse)
        err, own = float((out - ref_out).abs().max()), _own_error(ref_out, dtype)
        lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
        if err > 4 * own + 1e-5 or lse_err > 1e-3:
            bad.append(f"case {i} {dtype} {kind}: out error {err:.2e} (own {own:.2e}), lse error {lse_err:.2e}")
    return bad


def run_decode_op(rank: int, world: int, captured_calls: int = 8, replays: int = 10) -> tuple[list[str], list[str]]:
    """torch.ops.commopt.decode_attention over this rank's share of a bf16 cache (B 2, H 8, H_kv 2, one
    query, 2048 keys a rank, a prefix mask leaving the later ranks' shares empty for batch row 1):
    eager, then `captured_calls` calls on their own query buffers captured in one CUDA graph and
    replayed `replays` times on fresh queries and a fresh cache, an eager call between replays.
    Each result is checked against attention over the whole cache, and the same bits on every rank.
    Returns ([failures], [the transports the calls took, as logged])."""
    import torch_commopt  # noqa: F401  (registers the ops)

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    b, h, hkv, d, s_loc = 2, 8, 2, 128, 2048
    s = s_loc * world
    lengths = torch.tensor([s - 5, s_loc // 2], device=device)  # row 1: only rank 0's share has keys
    mask = (torch.arange(s, device=device) < lengths[:, None]).view(b, 1, 1, s)
    mine = slice(rank * s_loc, (rank + 1) * s_loc)

    def fresh(seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        q = torch.randn(b, h, 1, d, generator=gen, device=device).bfloat16()
        k = torch.randn(b, hkv, s, d, generator=gen, device=device).bfloat16()
        return q, k, torch.randn(b, hkv, s, d, generator=gen, device=device).bfloat16()

    def check(name, got, q, k, v, bad):
        truth, _ = local_partial(q, k, v, mask, 1 / math.sqrt(d))
        err, own = float((got.float() - truth).abs().max()), _own_error(truth, torch.bfloat16)
        if err > 4 * own + 1e-5:
            bad.append(f"{name}: error {err:.2e} vs the reference's own {own:.2e}")
        gathered = [None] * world
        dist.all_gather_object(gathered, got.cpu())
        if any(not torch.equal(x, gathered[0]) for x in gathered):
            bad.append(f"{name}: ranks differ")

    def op(q, k_loc, v_loc):
        return torch.ops.commopt.decode_attention(q, k_loc, v_loc, mask[..., mine], None, world, group.group_name)

    bad = []
    q, k, v = fresh(1)
    check("eager", op(q, k[:, :, mine].contiguous(), v[:, :, mine].contiguous()), q, k, v, bad)
    qs = [torch.zeros(b, h, 1, d, device=device, dtype=torch.bfloat16) for _ in range(captured_calls)]
    k_loc = torch.zeros(b, hkv, s_loc, d, device=device, dtype=torch.bfloat16)
    v_loc = torch.zeros_like(k_loc)
    outs = []
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        op(qs[0], k_loc, v_loc)  # warm-up outside the capture
        with torch.cuda.graph(graph, stream=stream):
            for i in range(captured_calls):
                outs.append(op(qs[i], k_loc, v_loc))
    torch.cuda.current_stream(device).wait_stream(stream)
    for r in range(replays):
        _, k, v = fresh(1000 + r)
        k_loc.copy_(k[:, :, mine])
        v_loc.copy_(v[:, :, mine])
        queries = [fresh(2000 + 16 * r + i)[0] for i in range(captured_calls)]
        for dst, src in zip(qs, queries):
            dst.copy_(src)
        graph.replay()
        for i in range(captured_calls):
            check(f"replay {r} call {i}", outs[i], queries[i], k, v, bad)
        q_e, k_e, v_e = fresh(5000 + r)  # an eager call between replays
        check(f"eager after replay {r}", op(q_e, k_e[:, :, mine].contiguous(), v_e[:, :, mine].contiguous()),
              q_e, k_e, v_e, bad)
    from torch_commopt.kernels.attention import decode

    return bad, sorted(decode._told)  # noqa: SLF001
