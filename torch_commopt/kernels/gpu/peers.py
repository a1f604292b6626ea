"""Whether every rank of a group can map its peers' symmetric memory: all on one host, with peer
access between every pair of this process's GPUs.  Decided once per group by all ranks together
(one small all-reduce), so no rank goes on alone; the copy-engine transports (the attention's
all-to-alls, expert parallelism's exchange) ask before allocating anything."""

from __future__ import annotations

import socket
import zlib

import torch
import torch.distributed as dist

_AGREED: dict[str, tuple[bool, str]] = {}  # group name -> (every rank can take part, why not)


def vote(group, device: torch.device, host: str, peers: bool) -> tuple[bool, str]:
    """(every rank is on `host`'s host and has peer access, why not): the same answer on every
    rank of `group` (collective)."""
    mine = zlib.crc32(host.encode())
    votes = torch.tensor([mine, -mine, int(peers)], dtype=torch.int64, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    low, high, all_peers = votes.tolist()
    if low != -high:
        return False, "spans hosts"
    if not all_peers:
        return False, "has GPUs without peer access"
    return True, ""


def agreed(group, device: torch.device) -> tuple[bool, str]:
    """(whether every rank of `group` can take part, why not), voted at the group's first ask and
    remembered (every rank asks at the same call: the callers decide from values equal on all)."""
    name = group.group_name
    if name not in _AGREED:
        index = device.index if device.index is not None else torch.cuda.current_device()
        peers = all(torch.cuda.can_device_access_peer(index, j) for j in range(torch.cuda.device_count()) if j != index)
        _AGREED[name] = vote(group, device, socket.gethostname(), peers)
    return _AGREED[name]


def known(group_name: str) -> bool | None:
    """The group's remembered answer, None before its vote."""
    got = _AGREED.get(group_name)
    return None if got is None else got[0]
