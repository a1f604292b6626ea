"""Process groups by name: the functional collectives in a graph name their group by a string."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a graph's collective names (a `group_name` string)."""
    return _resolve_process_group(group_name)


def group_role(group_name: str) -> str:
    """A group by its size and the gaps between its ranks: a mesh dimension's groups (rows {0, 2}
    and {1, 3} of a 2 x 2 mesh) all look alike, whatever their names.  (Not cached: a name can
    be another group's after a process group is destroyed and made again.)"""
    ranks = sorted(dist.get_process_group_ranks(resolve_group(group_name)))
    return f"group of {len(ranks)}, steps {[b - a for a, b in zip(ranks, ranks[1:])]}"
