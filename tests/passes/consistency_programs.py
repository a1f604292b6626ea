"""Workers for the rank-consistency tests (importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_commopt
from torch_commopt.core import consistency


def _program(a, b):
    return funcol.all_gather_tensor(a, gather_dim=0, group=dist.group.WORLD.group_name) @ b


def forced_mismatch(rank: int, world: int):
    """Rank 1 computes a different plan hash: no rank may rewrite, and results stay right."""
    if rank == 1:
        consistency.plan_hash = lambda decisions: "forced-different"
    torch_commopt.reset_explain()
    gen = torch.Generator().manual_seed(rank)
    a, b = torch.randn(6, 8, generator=gen), torch.randn(8, 4, generator=torch.Generator().manual_seed(9))
    out = torch.compile(_program, backend="commopt")(a, b)
    expected = _program(a, b)
    (graph,) = torch_commopt.explain().graphs
    return {
        "rewritten": len(graph.rewritten),
        "collectives_after": graph.collectives_after,
        "notes": graph.notes,
        "max_abs_diff": float((out - expected).abs().max()),
    }


def one_rank_missing(rank: int, world: int):
    """Only rank 0 publishes a plan: it must give up after the timeout, not hang."""
    if rank != 0:
        return None
    return consistency.ranks_agree([dist.group.WORLD.group_name], "x", timeout_s=2.0)


def values_differ(rank: int, world: int):
    return consistency.ranks_agree([dist.group.WORLD.group_name], f"value-{rank % 2}", timeout_s=60.0)


class _BrokenStore:
    """A c10d store whose server is gone (every call raises, as a broken pipe does)."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError("Broken pipe")
        return fail


def store_unreachable(rank: int, world: int):
    """ranks_agree with the store gone: an answer (not agreed), never an exception."""
    dist.distributed_c10d._get_default_store = lambda: _BrokenStore()
    return consistency.ranks_agree([dist.group.WORLD.group_name], "x", timeout_s=2.0)
