"""Process groups by name: the functional collectives in a graph name their group by a string."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a graph's collective names (a `group_name` string)."""
    return _resolve_process_group(group_name)
