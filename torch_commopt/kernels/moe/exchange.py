"""Expert parallelism's token exchange: the routing counts, and the differentiable transfers the
reference schedules are built from (any backend: gloo on CPU, NCCL on GPUs).

The layout is torchtitan's (docs/moe.md).  A rank's routed tokens are x (T, D), sorted by expert
over all E experts, with counts (E,) the tokens per expert.  Rank q of the EP group owns experts
[q * nl, (q + 1) * nl), nl = E / W, so the rows a rank sends to q are one contiguous run of x,
expert-major.  What rank r receives from source p is p's run for r, expert-major too: `recv[p][e]`
rows for r's local expert e.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels import collectives
from torch_commopt.kernels.moe.runs import gather_padded

log = logging.getLogger(__name__)
_told: set[str] = set()


@dataclass(frozen=True)
class Routing:
    """Who sends how many tokens to whom, for one call on one rank of an EP group.

    send[q][e]: rows this rank sends to rank q for q's local expert e;
    recv[p][e]: rows this rank receives from rank p for its own local expert e;
    peak: the most rows any rank of the group routes in this call (the same on every rank: what a
    symmetric buffer that any source may fill must hold); None when not exchanged."""

    rank: int
    world: int
    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    peak: int | None = None

    @property
    def local_experts(self) -> int:
        return len(self.send[0])

    def send_rows(self, q: int) -> int:
        return sum(self.send[q])

    def recv_rows(self, p: int) -> int:
        return sum(self.recv[p])

    def send_offset(self, q: int) -> int:
        """Where rank q's run starts in this rank's sorted tokens."""
        return sum(self.send_rows(i) for i in range(q))

    def per_expert(self) -> tuple[int, ...]:
        """Rows of each local expert over every source (what the experts see, expert-major)."""
        return tuple(sum(self.recv[p][e] for p in range(self.world)) for e in range(self.local_experts))


HOST = "_commopt_host_counts"  # the attribute counts_on() keeps a counts tensor's host values in


def counts_on(values, device, dtype: torch.dtype = torch.int64) -> Tensor:
    """Per-expert row counts (host ints) as a tensor on `device`, with no stream sync
    (`torch.tensor(values, device=cuda)` waits for the stream: a blocking copy), the host values
    kept on the tensor for host_counts: the experts between two exchanges then never stall the
    host, which runs ahead and queues the next kernels while the GPU computes."""
    values = [int(v) for v in values]
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)  # the caching host allocator keeps it until copied
    setattr(t, HOST, values)
    return t


def host_counts(per_expert: Tensor) -> list[int]:
    """The counts of a counts_on() tensor without reading the device; any other tensor is read
    (a stream sync)."""
    values = getattr(per_expert, HOST, None)
    return list(values) if values is not None else per_expert.tolist()


class _GatherRows(torch.autograd.Function):
    """x.index_select(0, index) for an index without repeats; the backward writes each row's
    gradient once (index_copy_) where index_select's own accumulates with atomics (index_add_,
    slow in bf16: 0.9 ms of an 11 ms MoE layer step on an H200), or, given index's inverse,
    gathers (runs.gather_padded: an indexed copy runs at under half the copy speed)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, covers: bool, inverse: Tensor | None) -> Tensor:
        ctx.save_for_backward(index if inverse is None else inverse)
        ctx.rows, ctx.covers, ctx.inverted = x.shape[0], covers, inverse is not None
        # with an inverse, index may name no row (len(x): a zero row, e.g. an expert's padding)
        return x.index_select(0, index) if inverse is None else gather_padded(x, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        if ctx.inverted:
            return gather_padded(grad.contiguous(), index), None, None, None
        shape = (ctx.rows,) + tuple(grad.shape[1:])
        out = grad.new_empty(shape) if ctx.covers else grad.new_zeros(shape)
        return out.index_copy_(0, index, grad), None, None, None


def inverse_of(index: Tensor, rows: int) -> Tensor:
    """For each of `rows` rows, its position in `index` (an index without repeats into them, but
    for entries equal to `rows`, which name no row), or len(index) where index names it nowhere:
    gather_rows' inverse of index."""
    inverse = torch.full((rows + 1,), index.numel(), dtype=index.dtype, device=index.device)
    inverse[index] = torch.arange(index.numel(), dtype=index.dtype, device=index.device)
    return inverse[:rows]


def gather_rows(x: Tensor, index: Tensor, covers: bool = False, inverse: Tensor | None = None) -> Tensor:
    """x[index] along dim 0 for an index without repeats (covers: it names every row of x, a
    permutation); differentiable, its backward a scatter without accumulation, or a gather where
    `inverse` is given (for each row of x its position in index, len(index) where none takes it;
    index may then name no row, len(x), for a zero row)."""
    return _GatherRows.apply(x, index, covers, inverse)


def ranges(pairs: list[tuple[int, int]], device) -> Tensor:
    """The concatenation of range(start, start + n) over `pairs`, built on `device` by tensor ops
    (no per-row host loop: a rank's routed rows run to 10^5 and more)."""
    total = sum(n for _, n in pairs)
    if not total:
        return torch.zeros(0, dtype=torch.int64, device=device)
    both = torch.tensor(pairs, dtype=torch.int64).to(device, non_blocking=True)
    starts, lens = both[:, 0], both[:, 1]
    shift = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens, output_size=total)
    return shift + torch.arange(total, dtype=torch.int64, device=device)


def exchange_counts(counts: Tensor, group: dist.ProcessGroup) -> Routing:
    """The Routing of a call whose sorted tokens have `counts` (E,) per expert: one all-to-all of
    the counts, each rank's piece carrying its total rows too, then one host read (the split
    sizes of a host-driven exchange, and the call's peak)."""
    return post_counts(counts, group).routing()


class PendingCounts:
    """The counts' all-to-all posted, their host read not yet done (`post_counts`).  On CUDA the
    counts come to pinned memory behind an event, so work queued between `post_counts` and
    `routing()` runs on the GPU while the host waits for them and then plans the exchange:
    the GPU idles from the read to the first transfer otherwise."""

    def __init__(self, rows: Tensor, rank: int, world: int):
        self.rank, self.world, self.event = rank, world, None
        if rows.is_cuda:
            self.rows = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self.rows.copy_(rows, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.rows = rows

    def routing(self) -> Routing:
        if self.event is not None:
            self.event.synchronize()
        rows = self.rows.view(2 * self.world, -1).tolist()
        got, sent = rows[:self.world], rows[self.world:]
        return Routing(self.rank, self.world, tuple(tuple(row[:-1]) for row in sent),
                       tuple(tuple(row[:-1]) for row in got), max(row[-1] for row in got))


def post_counts(counts: Tensor, group: dist.ProcessGroup) -> PendingCounts:
    """exchange_counts in two steps: the all-to-all of the counts posted, their host read left to
    the returned PendingCounts' routing()."""
    world, rank = group.size(), group.rank()
    experts = counts.numel()
    if experts % world:
        raise ValueError(f"commopt moe: {experts} experts do not divide over an expert-parallel group of {world}")
    per = counts.detach().reshape(world, -1).to(torch.int64)
    mine = torch.cat([per, per.sum().expand(world, 1)], dim=1).reshape(-1)  # [q]: counts for q, my rows
    if staged(mine, group):
        mine = mine.cpu()
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    return PendingCounts(torch.cat([theirs, mine]), rank, world)


def _global(group: dist.ProcessGroup, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def staged(t: Tensor, group) -> bool:
    """Whether `t` travels through host memory: gloo moves no CUDA tensor point to point nor by
    all_to_all (ranks sharing one GPU run gloo: kernels/gpu/shared_device.py).  Logged once."""
    if not collectives.staged(t, group):
        return False
    if "gloo" not in _told:
        _told.add("gloo")
        log.warning("commopt moe: gloo moves no CUDA tensors; the token exchange is staged through host memory")
    return True


def all_to_all_single(out: Tensor, x: Tensor, out_splits, in_splits, group) -> None:
    """dist.all_to_all_single, completed before it returns, staged through host memory where gloo
    moves CUDA tensors (`staged`)."""
    if staged(x, group):
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, x.cpu(), out_splits, in_splits, group=group)
        out.copy_(host)
        return
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)


class _Landing:
    """A staged swap's transfers: waiting for them copies the host receive into its device buffer."""

    def __init__(self, requests: list, host: Tensor, buf: Tensor):
        self.requests, self.host, self.buf = requests, host, buf

    def wait(self) -> None:
        for req in self.requests:
            req.wait()
        self.buf.copy_(self.host)


class AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        all_to_all_single(out, x.contiguous(), out_splits, in_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        all_to_all_single(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def swap_start(x: Tensor, dst: int, src: int, rows: int, group) -> tuple[Tensor, list]:
    """Send x to group rank dst and receive `rows` rows (x's row shape and dtype) from group rank
    src, both started: (the receive buffer, the requests to wait on).  A side with nothing to
    move posts nothing (both ends know the sizes from the Routing)."""
    buf = x.new_empty((rows,) + tuple(x.shape[1:]))
    through_host = staged(x, group)
    ops = []
    if x.shape[0]:
        ops.append(dist.P2POp(dist.isend, x.contiguous().cpu() if through_host else x.contiguous(), _global(group, dst), group))
    land = torch.empty(buf.shape, dtype=buf.dtype) if through_host else buf
    if rows:
        ops.append(dist.P2POp(dist.irecv, land, _global(group, src), group))
    requests = dist.batch_isend_irecv(ops) if ops else []
    return buf, ([_Landing(requests, land, buf)] if through_host and rows else requests)


def wait_all(requests) -> None:
    for req in requests:
        req.wait()


class Pending:
    """A swap posted by `post_swap` and not yet waited for (its requests, and its route for the
    backward)."""

    __slots__ = ("requests", "route", "rows_x")

    def __init__(self, route: tuple, rows_x: int):
        self.requests, self.route, self.rows_x = [], route, rows_x


class _Posted(torch.autograd.Function):
    """Forward: the swap posted, its receive buffer returned before it is filled (`_Waited` waits).
    Backward: the gradient of what came from src goes back to src and x's gradient comes from dst,
    posted and waited for at once."""

    @staticmethod
    def forward(ctx, x: Tensor, dst: int, src: int, rows: int, group, pending: Pending) -> Tensor:
        ctx.pending = pending
        buf, pending.requests = swap_start(x, dst, src, rows, group)
        return buf

    @staticmethod
    def backward(ctx, grad: Tensor):
        dst, src, group = ctx.pending.route
        back, reqs = swap_start(grad, src, dst, ctx.pending.rows_x, group)
        wait_all(reqs)
        return back, None, None, None, None, None


class _Waited(torch.autograd.Function):
    """Forward: wait for a posted swap; its buffer, now filled.  Backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, buf: Tensor, pending: Pending) -> Tensor:
        wait_all(pending.requests)
        pending.requests = []
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def post_swap(x: Tensor, dst: int, src: int, rows: int, group) -> tuple[Tensor, Pending]:
    """x to group rank dst and `rows` rows from group rank src, posted and not waited for: (the
    receive buffer, not to be read before `finish_swap`, and the pending transfer).
    Differentiable through finish_swap (_Posted's backward swaps the gradient back)."""
    pending = Pending((dst, src, group), x.shape[0])
    return _Posted.apply(x, dst, src, rows, group, pending), pending


def finish_swap(buf: Tensor, pending: Pending) -> Tensor:
    """Wait for a posted swap: its received rows."""
    return _Waited.apply(buf, pending)
