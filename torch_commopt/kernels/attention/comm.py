"""The communication pieces of the schedules: a double-buffered ring shift, a packed
all-to-all, sequence <-> heads and contiguous <-> zigzag relayouts, sub-groups.

Any backend (gloo on CPU, NCCL on GPU).  A `group` of None stands for a rank alone (a
degree-1 part of a hybrid): every piece then runs without communicating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels.attention import switches

log = logging.getLogger("torch_commopt.kernels.attention.comm")

Group = Optional[dist.ProcessGroup]
_ALIGN = 16  # bytes: every packed piece starts aligned, so it can be viewed back as any dtype


def size(group: Group) -> int:
    return 1 if group is None else group.size()


def rank(group: Group) -> int:
    return 0 if group is None else group.rank()


def views(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """The tensors of `shapes` packed one after another in `flat`, as views of it."""
    out, offset = [], 0
    for shape in shapes:
        out.append(flat[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return out


class RingShift:
    """Tensors shifted one peer along the ring per step: group rank p sends to p+1 and
    receives from p-1.  Double-buffered: `start()` sends the current buffer while the
    next one is received into the other, so the caller issues step i+1's transfer before
    computing on step i's tensors (`current()`), then `wait()`s and flips.  Any backend
    (NCCL's send/recv kernels on a GPU); ce_ring.CEShift is the copy-engine variant with the
    same interface, chosen by `ring_shift`.

    tensors: same dtype and device; packed into one flat buffer (one message per step).
    tag: distinguishes concurrent shifts between the same peers (gloo matches by tag;
        NCCL in issue order, which is the same on every rank).
    """

    def __init__(self, tensors: Sequence[Tensor], group: Group, tag: int) -> None:
        self.shapes = [t.shape for t in tensors]
        self.bufs = [torch.cat([t.reshape(-1) for t in tensors]), None]
        self.group, self.tag, self.cur, self.works = group, tag, 0, []
        n = size(group)
        if n > 1:
            p = group.rank()
            self.peers = (dist.get_global_rank(group, (p + 1) % n), dist.get_global_rank(group, (p - 1) % n))

    def current(self) -> list[Tensor]:
        """Views of the tensors of this step."""
        return views(self.bufs[self.cur], self.shapes)

    def start(self) -> None:
        if self.group is None or self.group.size() == 1:
            return
        if self.bufs[1 - self.cur] is None:
            self.bufs[1 - self.cur] = torch.empty_like(self.bufs[self.cur])
        nxt, prev = self.peers
        self.works = [_p2p([(self.bufs[self.cur], nxt, self.tag)], [(self.bufs[1 - self.cur], prev, self.tag)],
                           self.group)]

    def wait(self) -> None:
        if self.group is None or self.group.size() == 1:
            return
        for wait in self.works:
            wait()
        self.works, self.cur = [], 1 - self.cur

    def finish(self) -> None:
        """After the last use of the current tensors (nothing to release here)."""


class Unmoved:
    """A ring of one rank (Ulysses' attention, a hybrid's ring degree 1): the tensors stay
    where they are.  RingShift's interface without its packing copy, which here would be pure
    cost (Ulysses, 16K tokens, H 32: two 64 MiB cats a call, ~0.2 of 8.1 ms on an H200 pair)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = [t.contiguous() for t in tensors]  # as RingShift's views are

    def current(self) -> list[Tensor]:
        return self.tensors

    def start(self) -> None:
        raise RuntimeError("commopt attention: a ring of one rank has nothing to shift")

    def wait(self) -> None:
        raise RuntimeError("commopt attention: a ring of one rank has nothing to shift")

    def finish(self) -> None:
        pass


def ring_shift(tensors: Sequence[Tensor], group: Group, tag: int, channel: int = 0):
    """A RingShift, or on CUDA with TORCH_COMMOPT_ATTENTION_TRANSPORT=ce the copy-engine
    shift of kernels/attention/ce_ring.py (same interface: current, start, wait, finish); Unmoved
    for a ring of one rank.  channel: the copy-engine ring's (its buffer, flags and tokens); two
    shifts that run at once need two."""
    from torch_commopt.kernels.attention import ce_ring

    if size(group) == 1:
        return Unmoved(tensors)
    if ce_ring.usable(tensors, group, channel):
        from torch_commopt.kernels.gpu.symm import SymmAllocError

        try:
            return ce_ring.CEShift(tensors, group, channel)
        except SymmAllocError as e:  # on every rank of the group together, before anything moved
            refused_once(f"commopt attention: {e}; the ring runs on NCCL")
    return RingShift(tensors, group, tag)


def refused_once(message: str) -> None:
    """Log, once per message, a copy-engine transfer that fell back to NCCL."""
    switches.once(log, message, logging.WARNING, "%s", message)


def ring_pass(send: Sequence[Tensor], recv: Sequence["Spec"], group: Group,
              tag: int) -> Callable[[], list[Tensor]]:
    """One ring step of tensors that change dtype from hop to hop (the backward's dK/dV
    sums, ring.GradRing): send[i] goes to group rank p+1, a (shape, dtype) recv[i] comes
    from p-1, each under tag + i; no packing copy.  Returns a function that waits and gives
    the received tensors (the transfers are in flight meanwhile)."""
    n, p = size(group), rank(group)
    nxt, prev = dist.get_global_rank(group, (p + 1) % n), dist.get_global_rank(group, (p - 1) % n)
    got = [torch.empty(shape, dtype=dtype, device=send[0].device) for shape, dtype in recv]
    pending = _p2p([(t.contiguous(), nxt, tag + i) for i, t in enumerate(send)],
                   [(t, prev, tag + i) for i, t in enumerate(got)], group)

    def wait() -> list[Tensor]:
        pending()
        return got
    return wait


def _p2p(sends: Sequence[tuple[Tensor, int, int]], recvs: Sequence[tuple[Tensor, int, int]],
         group: dist.ProcessGroup) -> Callable[[], None]:
    """Issue (tensor, global peer, tag) sends and receives as one batch; returns the wait.
    gloo's send/recv read and write host memory only: with CUDA tensors on a gloo group the
    messages are staged through host copies (slow, but right; e.g. ranks sharing one GPU in
    the GPU tests, kernels/gpu/shared_device.py)."""
    staged = any(t.is_cuda for t, _, _ in [*sends, *recvs]) and dist.get_backend(group) == "gloo"
    if staged:
        sends = [(t.cpu(), peer, tag) for t, peer, tag in sends]
        targets = [t for t, _, _ in recvs]
        recvs = [(torch.empty(t.shape, dtype=t.dtype), peer, tag) for t, peer, tag in recvs]
    ops = [dist.P2POp(dist.isend, t, peer, group, tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for t, peer, tag in recvs]
    works = dist.batch_isend_irecv(ops)

    def wait() -> None:
        for work in works:
            work.wait()
        if staged:
            for target, (host, _, _) in zip(targets, recvs):
                target.copy_(host)
    return wait


def _as_bytes(t: Tensor) -> Tensor:
    flat = t.contiguous().view(-1).view(torch.uint8)
    pad = -flat.numel() % _ALIGN
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = torch.Size(shape).numel() * dtype.itemsize
    return n + (-n % _ALIGN)


Spec = tuple[Sequence[int], torch.dtype]


def exchange(send: list[list[Tensor]], recv: list[list[Spec]], group: Group, device: torch.device,
             async_op: bool = False):
    """One all-to-all of mixed tensors: send[d] go to group rank d; recv[s] lists the
    (shape, dtype) that group rank s sends here, in its order.  Packed as bytes, so one
    collective carries any dtypes (an output and its fp32 lse together).  Returns the
    received tensors per source rank; with async_op, a function that waits and returns them
    (the collective is in flight meanwhile).  This rank's own pieces do not travel: they are
    returned as given (views of the caller's tensors: not to be written), which saves a
    packing copy and the collective's local copy of them."""
    if group is None:
        got = [[t.clone() for t in send[0]]]
        return (lambda: got) if async_op else got
    me = group.rank()
    chunks = [[] if d == me else [_as_bytes(t) for t in pieces] for d, pieces in enumerate(send)]
    in_splits = [sum(c.numel() for c in cs) for cs in chunks]
    out_splits = [0 if s == me else sum(_nbytes(sh, dt) for sh, dt in specs) for s, specs in enumerate(recv)]
    flat = torch.cat([c for cs in chunks for c in cs]) if sum(in_splits) else torch.empty(0, dtype=torch.uint8,
                                                                                          device=device)
    out = torch.empty(sum(out_splits), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(out, flat, out_splits, in_splits, group=group, async_op=async_op)

    def unpack() -> list[list[Tensor]]:
        if work is not None:
            work.wait()
        result, offset = [], 0
        for s, specs in enumerate(recv):
            if s == me:
                result.append(list(send[me]))
                continue
            pieces = []
            for shape, dtype in specs:
                n = torch.Size(shape).numel() * dtype.itemsize
                pieces.append(out[offset : offset + n].view(dtype).view(shape))
                offset += _nbytes(shape, dtype)
            result.append(pieces)
        return result
    return unpack if async_op else unpack()


def seq_to_heads(xs: Sequence[Tensor], group: Group, async_op: bool = False):
    """Ulysses all-to-all: each x (B, H_x, S_loc, *tail) -> (B, H_x / n, n * S_loc, *tail),
    this rank keeping head block `rank` of the whole sequence (n = group size).  With
    async_op, a function that waits and gives the list (the all-to-all in flight)."""
    n = size(group)
    if n == 1:
        return (lambda: list(xs)) if async_op else list(xs)
    send = [[x[:, d * (x.shape[1] // n) : (d + 1) * (x.shape[1] // n)] for x in xs] for d in range(n)]
    spec = [((x.shape[0], x.shape[1] // n) + tuple(x.shape[2:]), x.dtype) for x in xs]
    pending = exchange(send, [spec] * n, group, xs[0].device, async_op=True)

    def assemble() -> list[Tensor]:
        got = pending()
        return [torch.cat([got[s][i] for s in range(n)], dim=2) for i in range(len(xs))]
    return assemble if async_op else assemble()


def heads_to_seq(xs: Sequence[Tensor], group: Group, async_op: bool = False,
                 out: Optional[Sequence[Tensor]] = None):
    """Inverse of seq_to_heads: each x (B, h, n * S_loc, *tail) -> (B, n * h, S_loc, *tail).
    out: tensors of those shapes to write the results into (else new ones); async_op as in
    seq_to_heads."""
    n = size(group)
    shapes = [(x.shape[0], n * x.shape[1], x.shape[2] // n) + tuple(x.shape[3:]) for x in xs]
    if n == 1:
        got = _into(out, [list(xs)], [[0]], 1, shapes)
        return (lambda: got) if async_op else got
    send = [[x[:, :, d * (x.shape[2] // n) : (d + 1) * (x.shape[2] // n)] for x in xs] for d in range(n)]
    spec = [((x.shape[0], x.shape[1], x.shape[2] // n) + tuple(x.shape[3:]), x.dtype) for x in xs]
    pending = exchange(send, [spec] * n, group, xs[0].device, async_op=True)

    def assemble() -> list[Tensor]:
        return _into(out, pending(), [[s] for s in range(n)], 1, shapes)
    return assemble if async_op else assemble()


def _into(out: Optional[Sequence[Tensor]], got: list[list[Tensor]], order: list[list[int]], dim: int,
          shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Tensor i of the result: the pieces got[s][j * len(shapes) + i] for (s, j) in the order
    (order[s]: the result positions of source s's pieces) concatenated along dim -- written
    into out[i] where given (one copy per piece), else a new tensor."""
    count = len(shapes)
    where = sorted((pos, s, j) for s, poss in enumerate(order) for j, pos in enumerate(poss))
    result = []
    for i in range(count):
        pieces = [got[s][j * count + i] for _, s, j in where]
        if out is None:
            result.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim))
            continue
        dst = out[i]
        if tuple(dst.shape) != tuple(shapes[i]):
            raise ValueError(f"commopt attention: result {i} has shape {tuple(shapes[i])}, out {tuple(dst.shape)}")
        offset = 0
        for piece in pieces:
            dst.narrow(dim, offset, piece.shape[dim]).copy_(piece)
            offset += piece.shape[dim]
        result.append(dst)
    return result


def zigzag_chunks(p: int, n: int) -> list[int]:
    """Sequence chunks (of 2n) that rank p holds in the zigzag layout, in local order."""
    return [p, 2 * n - 1 - p]


def contiguous_chunks(p: int, n: int) -> list[int]:
    return [2 * p, 2 * p + 1]


def relayout(xs: Sequence[Tensor], group: Group, now: Callable[[int, int], list[int]],
             then: Callable[[int, int], list[int]], async_op: bool = False,
             out: Optional[Sequence[Tensor]] = None):
    """Move sequence chunks between ranks: x (B, H, S_loc, *tail) holds chunks now(rank, n)
    along dim 2 (equal lengths); returns x holding chunks then(rank, n).  One all-to-all
    for all xs (chunks travel in ascending chunk order between each pair of ranks).  With
    async_op, returns a function that waits and gives the list (the all-to-all in flight);
    out: tensors of the xs' shapes to write the results into (else new ones)."""
    n, p = size(group), rank(group)
    shapes = [x.shape for x in xs]
    if n == 1:
        got = _into(out, [list(xs)], [[0]], 2, shapes)
        return (lambda: got) if async_op else got
    c = xs[0].shape[2] // len(now(p, n))
    mine = now(p, n)
    piece = {ch: [x[:, :, i * c : (i + 1) * c] for x in xs] for i, ch in enumerate(mine)}
    send = [[t for ch in sorted(set(mine) & set(then(d, n))) for t in piece[ch]] for d in range(n)]
    wanted = then(p, n)
    recv_chunks = [sorted(set(now(s, n)) & set(wanted)) for s in range(n)]
    spec = [((x.shape[0], x.shape[1], c) + tuple(x.shape[3:]), x.dtype) for x in xs]
    pending = exchange(send, [spec * len(chs) for chs in recv_chunks], group, xs[0].device, async_op=True)
    order = [[wanted.index(ch) for ch in chs] for chs in recv_chunks]

    def assemble() -> list[Tensor]:
        return _into(out, pending(), order, 2, shapes)
    return assemble if async_op else assemble()


def subgroup(ranks: list[int]) -> dist.ProcessGroup:
    """The process group of exactly these global ranks, in this order (group rank i is
    ranks[i]): an existing one if the program has it, else created.  Created with local
    synchronization, so only its members take part (the parent group may be part of a larger
    world); every member creates its groups in the same order.  Looked up in c10d's own
    registry rather than cached here, so a group destroyed with its world is never reused."""
    key = list(ranks)
    for pg in dist.distributed_c10d._world.pg_group_ranks:
        if dist.get_process_group_ranks(pg) == key:
            return pg
    pg = dist.new_group(key, use_local_synchronization=True)
    if dist.get_process_group_ranks(pg) != key:
        raise RuntimeError(f"commopt attention: sub-group of ranks {key} came out ordered "
                           f"{dist.get_process_group_ranks(pg)}")
    return pg


def hybrid_groups(group: dist.ProcessGroup, u: int, r: int) -> tuple[Group, Group]:
    """(Ulysses group, ring group) of this rank for hybrid:u:r over `group`: Ulysses over u
    consecutive group ranks (so their gathered sequence is one contiguous segment), the
    ring over the r ranks at the same position in each segment.  None for a degree of 1."""
    members = dist.get_process_group_ranks(group)
    if u * r != len(members):
        raise ValueError(f"hybrid:{u}:{r}: degrees do not multiply to the group size {len(members)}")
    p = group.rank()
    seg, pos = divmod(p, u)
    uranks = members[seg * u : (seg + 1) * u]
    rranks = members[pos::u]
    ugroup = None if u == 1 else group if u == len(members) else subgroup(uranks)
    rgroup = None if r == 1 else group if r == len(members) else subgroup(rranks)
    return ugroup, rgroup
