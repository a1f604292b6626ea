"""Per-rank programs: all-gather context parallelism compiled with backend="commopt"."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import torch_commopt


def _allgather_cp(q, k, v, gqa: bool):
    """The torchtitan-style program: K and V gathered along the sequence, local queries."""
    kf = funcol.all_gather_tensor(k, gather_dim=2, group=dist.group.WORLD)
    vf = funcol.all_gather_tensor(v, gather_dim=2, group=dist.group.WORLD)
    return F.scaled_dot_product_attention(q, kf, vf, enable_gqa=gqa)


def _allgather_cp_bshd(q, k, v, gqa: bool):
    """The same with (B, S, H, D) activations gathered before the transpose to (B, H, S, D)."""
    kf = funcol.all_gather_tensor(k, gather_dim=1, group=dist.group.WORLD).transpose(1, 2)
    vf = funcol.all_gather_tensor(v, gather_dim=1, group=dist.group.WORLD).transpose(1, 2)
    return F.scaled_dot_product_attention(q.transpose(1, 2), kf, vf, enable_gqa=gqa).transpose(1, 2)


def compiled_cp(rank: int, world: int, layout: str, heads: tuple[int, int], grad: bool, schedule: str = "auto"):
    """(max relative error vs full attention on the gathered sequence, explain notes,
    all-gathers left in the compiled graphs)."""
    h, h_kv = heads
    b, s_loc, d = 2, 8, 16
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(b, h_, world * s_loc, d, generator=gen) for h_ in (h, h_kv, h_kv)]
    want = F.scaled_dot_product_attention(*full, enable_gqa=h != h_kv).chunk(world, dim=2)[rank]
    local = [t.chunk(world, dim=2)[rank].contiguous() for t in full]
    fn = _allgather_cp
    if layout == "bshd":
        local = [t.transpose(1, 2).contiguous() for t in local]
        fn = _allgather_cp_bshd
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    compiled = torch.compile(fn, backend="commopt", options={"attention_schedule": schedule})
    if grad:
        local = [t.requires_grad_(True) for t in local]
        got = compiled(*local, h != h_kv)
    else:
        with torch.no_grad():
            got = compiled(*local, h != h_kv)
    if layout == "bshd":
        got = got.transpose(1, 2)
    graphs = torch_commopt.explain().graphs
    notes = [n for g in graphs for n in g.notes if n.startswith("attention")]
    gathers = sum(g.collectives_after.get("all_gather", 0) for g in graphs)
    err = float((got.detach() - want).norm() / want.norm())
    return err, notes, gathers


def head_parallel_notes(rank: int, world: int):
    """Explain's attention notes for a TP block (heads sharded, no sequence sharding)."""
    from torch_commopt.validate import check

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    check("tp_block", {}, shape={"batch": 2, "seq": 8, "dim": 32, "hidden": 64, "heads": 2 * world})
    return [n for g in torch_commopt.explain().graphs for n in g.notes if n.startswith("attention")]
