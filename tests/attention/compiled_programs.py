"""Per-rank programs: all-gather context parallelism compiled with backend="commopt"."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import torch_commopt
from torch_commopt.testing.validate import TOLERANCE_FACTOR, rel_err, within_tolerance


def close(errs, factor: float = TOLERANCE_FACTOR) -> bool:
    """Every (tensor, error, eager float32's error) against float64 within validate's rule."""
    return all(within_tolerance(c, e, factor) for _, c, e in errs)


def _gather(x, dim):  # differentiable (its backward is a reduce-scatter), as a training program needs
    return funcol.all_gather_tensor_autograd(x, gather_dim=dim, group=dist.group.WORLD)


def _allgather_cp(q, k, v, gqa: bool):
    """The torchtitan-style program: K and V gathered along the sequence, local queries."""
    return F.scaled_dot_product_attention(q, _gather(k, 2), _gather(v, 2), enable_gqa=gqa)


def _allgather_cp_causal(q, k, v, gqa: bool):
    """Causal: this rank's rows of the global causal mask, built from its rank."""
    s_loc = q.shape[2]
    rows = torch.arange(s_loc) + dist.get_rank() * s_loc
    mask = rows[:, None] >= torch.arange(s_loc * dist.get_world_size())[None, :]
    return F.scaled_dot_product_attention(q, _gather(k, 2), _gather(v, 2), attn_mask=mask, enable_gqa=gqa)


def _allgather_cp_bshd(q, k, v, gqa: bool):
    """The same with (B, S, H, D) activations gathered before the transpose to (B, H, S, D)."""
    kf, vf = _gather(k, 1).transpose(1, 2), _gather(v, 1).transpose(1, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), kf, vf, enable_gqa=gqa).transpose(1, 2)


def compiled_cp(rank: int, world: int, layout: str, heads: tuple[int, int], grad: bool, schedule: str = "auto",
                causal: bool = False, options: dict | None = None):
    """([(tensor, relative error, eager float32's relative error)] of out -- and with grad=True
    of dq, dk, dv -- against full attention on the whole sequence in float64, explain notes,
    all-gathers left in the compiled graphs).  options: more Config options."""
    h, h_kv = heads
    b, s_loc, d = 2, 8, 16
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn(b, h_, world * s_loc, d, generator=gen) for h_ in (h, h_kv, h_kv)]
    dout = torch.randn(b, h, world * s_loc, d, generator=gen)

    def full_attention(dtype):  # this rank's rows of out, dq, dk, dv of the whole sequence
        full = [t.detach().to(dtype).requires_grad_(True) for t in data]
        out = F.scaled_dot_product_attention(*full, enable_gqa=h != h_kv, is_causal=causal)
        out.backward(dout.to(dtype))
        return [t.detach().chunk(world, dim=2)[rank] for t in [out] + [t.grad for t in full]]

    truth, eager = full_attention(torch.float64), full_attention(torch.float32)
    local = [t.chunk(world, dim=2)[rank].contiguous() for t in data]
    fn = _allgather_cp_causal if causal else _allgather_cp
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
        fn = _allgather_cp_bshd
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(fn, backend="commopt", options={"attention_schedule": schedule, **(options or {})})
    if grad:
        local = [t.requires_grad_(True) for t in local]
        got = compiled(*local, h != h_kv)
        mine = dout.chunk(world, dim=2)[rank]
        got.backward(mine.transpose(1, 2) if layout == "bshd" else mine)
        grads = [t.grad.transpose(1, 2) if layout == "bshd" else t.grad for t in local]
    else:
        with torch.no_grad():
            got = compiled(*local, h != h_kv)
        grads = []
    if layout == "bshd":
        got = got.transpose(1, 2)
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes if "attention" in n]
    gathers = sum(g.collectives_after.get("all_gather", 0) for g in graphs)
    errs = [(name, rel_err(x, t), rel_err(e, t))
            for name, x, t, e in zip(("out", "dq", "dk", "dv"), [got] + grads, truth, eager)]
    return errs, notes, gathers


def head_parallel_notes(rank: int, world: int):
    """Explain's attention notes for a TP block (heads sharded, no sequence sharding)."""
    from torch_commopt.testing.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    check("tp_block", {}, shape={"batch": 2, "seq": 8, "dim": 32, "hidden": 64, "heads": 2 * world})
    return [n for g in torch_commopt.explain().graphs for n in g.notes if n.startswith("attention")]


def _rank_dependent_mask(q, k, v, gqa: bool):
    """Rank 0's mask is the global causal mask, rank 1's a sliding window: only rank 0 could
    rewrite, which would deadlock; both must keep the program as it is."""
    s_loc = q.shape[2]
    rows = torch.arange(s_loc)[:, None] + dist.get_rank() * s_loc
    cols = torch.arange(s_loc * dist.get_world_size())[None, :]
    mask = rows >= cols
    if dist.get_rank() != 0:
        mask = mask & (rows - cols < 3)
    return F.scaled_dot_product_attention(q, _gather(k, 2), _gather(v, 2), attn_mask=mask, enable_gqa=gqa)


def disagreeing_ranks(rank: int, world: int):
    """(relative error vs the same program run eagerly, explain notes)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=gen) for _ in range(3))
    want = _rank_dependent_mask(q, k, v, False)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(_rank_dependent_mask, backend="commopt", options={"consistency_timeout_s": 3.0})
    got = compiled(*(t.requires_grad_(True) for t in (q, k, v)), False)
    notes = [n for g in torch_commopt.explain().graphs for n in g.notes if "attention" in n]
    return float((got.detach() - want).norm() / want.norm()), notes


def _ulysses_program(world: int, causal: bool, interleaved: bool = False, autograd: bool = False):
    """DeepSpeed-style Ulysses on (B, S_loc, H, D) activations: all-to-all sequence -> heads,
    attention on H/W heads over the whole sequence, all-to-all back.  interleaved: the
    gathered sequence is laid out position-major (rank r's token i at i*W + r).  autograd:
    funcol's differentiable all-to-all (a training program)."""
    group = dist.group.WORLD
    a2a = funcol.all_to_all_single_autograd if autograd else funcol.all_to_all_single

    def seq_to_heads(x):  # (B, S_loc, H, D) -> (B, H/W, S, D)
        b, s, h, d = x.shape
        x = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
        y = a2a(x, None, None, group=group)  # (W_src, B, S_loc, H/W, D)
        order = (1, 2, 0, 3, 4) if interleaved else (1, 0, 2, 3, 4)
        return y.permute(*order).reshape(b, world * s, h // world, d).transpose(1, 2)

    def heads_to_seq(x):  # (B, H/W, S, D) -> (B, S_loc, H, D)
        b, h, s, d = x.shape
        x = x.transpose(1, 2)
        x = (x.reshape(b, s // world, world, h, d).permute(2, 0, 1, 3, 4) if interleaved
             else x.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4)).contiguous()
        y = a2a(x, None, None, group=group)  # (W_heads, B, S_loc, H/W, D)
        return y.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)

    def program(q, k, v):
        out = F.scaled_dot_product_attention(seq_to_heads(q), seq_to_heads(k), seq_to_heads(v), is_causal=causal,
                                             enable_gqa=True)
        return heads_to_seq(out)
    return program


def compiled_ulysses(rank: int, world: int, heads: tuple[int, int], causal: bool, schedule: str = "auto",
                     interleaved: bool = False):
    """([("out", relative error, eager float32's relative error)] against full attention on
    the whole sequence in float64, explain notes, all-to-alls left in the compiled graph) of a
    Ulysses program compiled with backend="commopt"."""
    h, h_kv = heads
    b, s_loc, d = 2, 8, 16
    gen = torch.Generator().manual_seed(4)
    full = [torch.randn(b, world * s_loc, h_, d, generator=gen) for h_ in (h, h_kv, h_kv)]  # (B, S, H, D)
    # interleaved: rank r holds tokens r, r+W, ...: the program's sequence order is position-major
    perm = (torch.arange(world * s_loc).view(s_loc, world).t().reshape(-1) if interleaved
            else torch.arange(world * s_loc))
    local = [t[:, perm].chunk(world, dim=1)[rank].contiguous() for t in full]

    def full_attention(dtype):  # this rank's rows of the output, in the program's sequence order
        ref = F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in full), is_causal=causal,
                                             enable_gqa=True)
        return ref.transpose(1, 2)[:, perm].chunk(world, dim=1)[rank]

    truth, eager = full_attention(torch.float64), full_attention(torch.float32)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    program = _ulysses_program(world, causal, interleaved)
    with torch.no_grad():
        got = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})(*local)
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes if "attention" in n]
    a2as = sum(g.collectives_after.get("all_to_all", 0) for g in graphs)
    return [("out", rel_err(got, truth), rel_err(eager, truth))], notes, a2as


def trained_ulysses(rank: int, world: int, heads: tuple[int, int], causal: bool, schedule: str = "auto",
                    return_saved: bool = False):
    """([(tensor, relative error, eager float32's relative error)] of out, dq, dk, dv against full
    attention in float64, notes, all-to-alls left[, bytes the compiled forward saved for its
    backward]) of a Ulysses training program (funcol's autograd all-to-all) compiled with
    backend="commopt"."""
    h, h_kv = heads
    b, s_loc, d = 2, 8, 16
    gen = torch.Generator().manual_seed(6)
    data = [torch.randn(b, world * s_loc, h_, d, generator=gen) for h_ in (h, h_kv, h_kv)]
    dout = torch.randn(b, world * s_loc, h, d, generator=gen)

    def full_attention(dtype):  # out, dq, dk, dv of the whole sequence
        full = [t.detach().to(dtype).requires_grad_(True) for t in data]
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=causal,
                                             enable_gqa=True).transpose(1, 2)
        out.backward(dout.to(dtype))
        return [out] + [t.grad for t in full]

    truth, eager = full_attention(torch.float64), full_attention(torch.float32)
    mine = lambda t: t.detach().chunk(world, dim=1)[rank]  # noqa: E731
    local = [mine(t).contiguous().requires_grad_(True) for t in data]
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    program = _ulysses_program(world, causal, autograd=True)
    saved = {}

    def pack(t):  # what the compiled forward keeps for its backward, by storage
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = torch.compile(program, backend="commopt", options={"attention_schedule": schedule})(*local)
    got.backward(mine(dout))
    errs = [(name, rel_err(x, mine(t)), rel_err(mine(e), mine(t)))
            for name, x, t, e in zip(("out", "dq", "dk", "dv"), [got] + [t.grad for t in local], truth, eager)]
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes if "attention" in n]
    a2as = sum(g.collectives_after.get("all_to_all", 0) for g in graphs)
    if not return_saved:
        return errs, notes, a2as
    return errs, notes, a2as, sum(saved.values())


def _decode(q, k, v, mask):
    """gpt-fast style decoding over a sequence-sharded cache: the cache gathered, a few queries."""
    kf = funcol.all_gather_tensor(k, gather_dim=2, group=dist.group.WORLD)
    vf = funcol.all_gather_tensor(v, gather_dim=2, group=dist.group.WORLD)
    if mask is None:
        return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, kf, vf, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def compiled_decode(rank: int, world: int, s_q: int, masked: bool):
    """(error of the compiled decode vs whole-cache attention in float64, eager float32's, the
    explain notes, the all-gathers left in the compiled graph, the result's bits on this rank)."""
    b, h, h_kv, s_loc, d = 2, 4, 2, 8, 16
    gen = torch.Generator().manual_seed(7 + s_q)
    q = torch.randn(b, h, s_q, d, generator=gen)
    k, v = (torch.randn(b, h_kv, world * s_loc, d, generator=gen) for _ in range(2))
    # a cache filled up to a length per batch row: the later ranks' shares masked for the first
    lengths = torch.tensor([3, world * s_loc - 2])
    mask = (torch.arange(world * s_loc).view(1, 1, 1, -1) < lengths.view(b, 1, 1, 1)).expand(b, 1, s_q, -1) \
        if masked else None

    def whole(dtype):
        m = None if mask is None else mask
        return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=m, enable_gqa=True)

    truth, eager = whole(torch.float64), whole(torch.float32)
    share = slice(rank * s_loc, (rank + 1) * s_loc)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(_decode, backend="commopt")
    with torch.no_grad():
        got = compiled(q, k[:, :, share].contiguous(), v[:, :, share].contiguous(), mask)
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes if "attention" in n]
    gathers = sum(g.collectives_after.get("all_gather", 0) for g in graphs)
    return rel_err(got, truth), rel_err(eager, truth), notes, gathers, got.flatten().tolist()
