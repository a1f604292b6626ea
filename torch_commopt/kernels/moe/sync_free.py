"""The `sync_free` schedule: the token exchange with every size on the device.

Every other schedule reads the counts on the host after exchanging them (as torchtitan's EP does):
the split sizes of its transfers and its run tables come from there.  That read drains the GPU's
queue, and the GPU then idles until the host has queued the next kernels; a call's shapes depend
on the counts, so the layer cannot be captured in a CUDA graph either.  Here nothing is read:

    counts    one all-gather of each rank's counts (E,) on the device, with one flag per rank
              (its counts do not add up to its rows)
    dispatch  this rank's rows for rank q gathered into block q of a [W, C, D] send buffer (C: the
              capacity, the most rows any rank routes, fixed once per group); one all-to-all of
              equal blocks: block p of the receive buffer holds rank p's rows for this rank's
              experts, expert-major, in its first rows
    experts   the received rows gathered into a padded expert-major buffer of a fixed W * C +
              nl * align rows (each local expert's group padded with zero rows to `align`; the rows
              past the last group are never read), the experts' SwiGLU over it: on a GPU in bf16
              one grouped GEMM per product with the group ends on the device
    combine   each source's outputs gathered back into its block, one all-to-all home, and this
              rank's rows picked out of the blocks in their own order

Every index is computed on the device from the gathered counts (cumsums and searchsorted), so a
call's shapes depend only on (rows, D, E, W, C): a new routing compiles nothing, the forward can
be captured in a CUDA graph and replayed on new routings, and no host read sits between the router
and the experts.  The price: each all-to-all
moves W * C rows a rank however few are routed (a fixed-capacity exchange, as DeepEP's
low-latency mode has), and the buffers are sized for the worst case -- the schedule for calls
whose rows are few (decoding, small batches), where the host read costs more than the bytes.

The capacity C is fixed at a group's first call (the most rows any of its ranks routes then: one
collective and one host read, once), or by `set_capacity` on every rank.  A later call in which
some rank routes more than C rows, or passes counts that do not add up to its rows, cannot be
told apart on the host without the read this schedule avoids: every rank sees it in the
gathered counts, the call's outputs become NaN on every rank, and a flag kept on the device
makes `check(group)` raise, on every rank alike, when the caller asks (one host read, where the
loss is read anyway).  No wrong result goes unmarked, and every rank runs the same collectives
whatever the counts.
"""

from __future__ import annotations

import collections
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch_commopt.kernels.moe.by_expert import gmm, gmm_wgrad
from torch_commopt.kernels.moe.exchange import AllToAll
from torch_commopt.kernels.moe.runs import gather_padded

log = logging.getLogger(__name__)
_CAPACITY: dict[str, int] = {}  # group name -> rows a rank may route (fixed at its first call)
_TRIPPED: dict[str, Tensor] = {}  # group name -> whether a call since the last check() was flagged (on the device)


def set_capacity(group, rows: int) -> None:
    """Fix `group`'s capacity to `rows` (the most rows a rank may route a call); every rank of the
    group must call it with the same value before its next sync_free call."""
    if rows < 1:
        raise ValueError(f"commopt moe sync_free: a capacity of {rows} rows")
    _CAPACITY[_name(group)] = int(rows)


def reset() -> None:
    """Forget every group's capacity and error flag (tests; a new process group)."""
    _CAPACITY.clear()
    _TRIPPED.clear()
    _PLANS.clear()


def _name(group) -> str:
    return group.group_name if group is not None else "default"


def capturing(device) -> bool:
    """Whether work on `device` is being captured into a CUDA graph (no host read may happen there)."""
    from torch_commopt.kernels.gpu.call_graphs import capturing as stream_capturing

    return torch.device(device).type == "cuda" and stream_capturing()


def note_peak(group, peak: int | None) -> None:
    """Grow `group`'s capacity to `peak`, the most rows any rank routed in a call whose counts the
    other schedules exchanged and read (the same value on every rank): their eager calls before a
    CUDA-graph capture size the sync_free exchange that the capture runs (module.py)."""
    if peak is not None:
        name = _name(group)
        _CAPACITY[name] = max(_CAPACITY.get(name, 1), int(peak))


def _capacity(group, rows: int, device) -> int:
    """The group's capacity: fixed at its first call as the most rows any rank routes (one
    all-reduce and one host read, once a group), or grown by the other schedules' calls."""
    name = _name(group)
    if name not in _CAPACITY and capturing(device):
        raise RuntimeError(f"commopt moe sync_free: group {name} has no capacity inside a CUDA-graph capture, which "
                           "cannot read one on the host: run the layer eagerly once first, or call "
                           "kernels.moe.sync_free.set_capacity on every rank")
    if name not in _CAPACITY:
        t = torch.tensor([rows], dtype=torch.int64)
        on_device = dist.get_backend(group) != "gloo"
        t = t.to(device) if on_device else t
        dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
        _CAPACITY[name] = max(1, int(t.item()))
    return _CAPACITY[name]


def _trip(group, bad: Tensor) -> None:
    """OR the call's error flag into the group's, on the device (read by `check`)."""
    name = _name(group)
    if name in _TRIPPED and _TRIPPED[name].device == bad.device:
        _TRIPPED[name].logical_or_(bad)
    else:
        _TRIPPED[name] = bad.clone()


def check(group) -> None:
    """Raise if a sync_free call on `group` since the last check had a rank route more rows than
    the capacity or pass counts that do not add up to its rows (their outputs were NaN on every
    rank).  It reads a flag the calls keep on the device: one host read, when the caller asks
    (e.g. where the loss is read anyway); the same answer on every rank."""
    tripped = _TRIPPED.get(_name(group))
    if tripped is None:
        return
    hit = bool(tripped.item())
    tripped.zero_()  # in place: a CUDA graph that captured a call keeps writing this very tensor
    if hit:
        raise RuntimeError(f"commopt moe sync_free: a call on group {_name(group)} had a rank route more rows than the "
                           f"capacity of {_CAPACITY.get(_name(group))} or pass counts that do not add up to its rows; "
                           "its outputs were NaN on every rank. Fix the capacity on every rank "
                           "(kernels.moe.sync_free.set_capacity) or the counts")


def _all_counts(counts: Tensor, rows: int, group) -> Tensor:
    """[W, E + 1] int64 on counts' device: every rank's counts, and last its flag (its counts do
    not add up to its rows); no host read on NCCL."""
    mine = torch.cat([counts.to(torch.int64), (counts.sum() != rows).to(torch.int64).reshape(1)])
    world = dist.get_world_size(group)
    if dist.get_backend(group) == "gloo":  # its list form, through the host for CUDA tensors
        parts = [torch.empty_like(mine, device="cpu") for _ in range(world)]
        dist.all_gather(parts, mine.cpu(), group=group)
        return torch.stack(parts).to(counts.device)
    out = mine.new_empty((world, mine.numel()))
    dist.all_gather_into_tensor(out, mine, group=group)
    return out


def _exclusive(t: Tensor, dim: int) -> Tensor:
    return torch.cumsum(t, dim) - t


class _PaddedGather(torch.autograd.Function):
    """runs.gather_padded(x, index): x's rows at `index` (each in [0, len(x)]: len(x) names no row
    and gives a zero row), every row `fill` where `flag` is set.  `inverse` is index's inverse
    (for each row of x, its position in index, or len(index) where none takes it: the plan's
    indices come in such pairs), so the backward is a gather too, with zeros where the flag is
    set: no indexed copy, which runs at under half the copy speed."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, inverse: Tensor, flag: Tensor | None, fill: float) -> Tensor:
        ctx.save_for_backward(inverse, flag)
        return gather_padded(x, index, flag, fill)

    @staticmethod
    def backward(ctx, grad: Tensor):
        inverse, flag = ctx.saved_tensors
        return gather_padded(grad.contiguous(), inverse, flag, 0.0), None, None, None, None


def _picked(x: Tensor, index: Tensor, inverse: Tensor, flag: Tensor | None = None, fill: float = 0.0) -> Tensor:
    return _PaddedGather.apply(x, index, inverse, flag, fill)


class _GroupedSwiGLU(torch.autograd.Function):
    """GroupedExperts' SwiGLU over expert-major rows whose group ends (int64, the last group's
    end at most the rows) are on the device: on a GPU in bf16 one grouped GEMM per product, the
    ends never read; elsewhere a loop over the experts (the ends read).  Rows past the last
    group are left unset and get no gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, ends: Tensor) -> Tensor:
        rows = h.shape[0]
        offs, sizes = _groups(h, ends)
        h = h if offs is not None else h[:sum(sizes)]
        h1, h3 = gmm(h, w1, sizes, offs), gmm(h, w3, sizes, offs)
        silu = F.silu(h1)
        act = silu * h3
        ctx.save_for_backward(h, w1, w2, w3, h1, h3, silu, act)
        ctx.groups, ctx.rows = (offs, sizes), rows
        return _rest(gmm(act, w2, sizes, offs), rows)

    @staticmethod
    def backward(ctx, dy: Tensor):
        h, w1, w2, w3, h1, h3, silu, act = ctx.saved_tensors
        offs, sizes = ctx.groups
        dy = dy[:h.shape[0]].contiguous()  # h: the rows the groups hold (all of them on the grouped GEMM)
        da = gmm(dy, w2.transpose(-2, -1), sizes, offs)
        dh3 = da * silu
        dh1 = torch.ops.aten.silu_backward(da * h3, h1)
        dh = _rest(gmm(dh1, w1.transpose(-2, -1), sizes, offs) + gmm(dh3, w3.transpose(-2, -1), sizes, offs),
                   ctx.rows)
        dw1 = gmm_wgrad(dh1, h, sizes, offs)
        dw2 = gmm_wgrad(dy, act, sizes, offs)
        dw3 = gmm_wgrad(dh3, h, sizes, offs)
        return dh, dw1, dw2, dw3, None


def _groups(h: Tensor, ends: Tensor) -> tuple[Tensor | None, list[int]]:
    """(offs for torch._grouped_mm, None elsewhere; the group sizes where the ends are read)."""
    if h.is_cuda and h.dtype == torch.bfloat16:
        return ends.to(torch.int32), []
    bounds = [0] + ends.tolist()  # the loop's host read (a CPU's, or a GPU's outside bf16)
    return None, [b - a for a, b in zip(bounds, bounds[1:])]


def _rest(y: Tensor, rows: int) -> Tensor:
    """y grown to `rows` rows with zeros (the loop computes the groups' rows only)."""
    return y if y.shape[0] == rows else torch.cat([y, y.new_zeros((rows - y.shape[0],) + tuple(y.shape[1:]))])


def _dispatch_index(counts: Tensor, rank: int, cap: int, rows: int) -> tuple[Tensor, Tensor]:
    """(send index [W * C]: this rank's row in block q's slot i, `rows` where the slot is empty;
    home index [rows]: where each of its rows comes back in the [W * C] blocks), from the
    gathered counts [W, E]."""
    world = counts.shape[0]
    tot = counts[rank].view(world, -1).sum(1)  # rows this rank sends each rank
    start = _exclusive(tot, 0)
    i = torch.arange(cap, device=counts.device)
    send = torch.where(i < tot[:, None], start[:, None] + i, rows).clamp(max=rows)
    t = torch.arange(rows, device=counts.device)
    q = torch.searchsorted(torch.cumsum(tot, 0), t, right=True).clamp(max=world - 1)
    home = (q * cap + (t - start[q]).clamp(0, cap - 1)).clamp(max=world * cap - 1)
    return send.flatten(), home


def _expert_index(counts: Tensor, rank: int, cap: int, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """(place [M]: for each row of the padded expert-major buffer, its row of the received blocks
    [W * C], W * C for a padding or unused row; ends: each local expert's group end in that
    buffer; back [W * C]: for each source's slot i, its row of the buffer, M for an empty slot),
    M = W * C + nl * align, from the gathered counts [W, E]."""
    world, dev = counts.shape[0], counts.device
    nl = counts.shape[1] // world
    n = counts[:, rank * nl:(rank + 1) * nl].clamp(max=cap)  # [W, nl]: rows from p for local expert e
    off, tot = _exclusive(n, 1), n.sum(0)  # expert e's start in p's block; expert e's rows
    padded = tot if align == 1 else torch.clamp(-(-tot // align) * align, min=align)
    rows = world * cap + nl * align
    ends = torch.cumsum(padded, 0).clamp(max=rows)  # within the buffer even for counts over the capacity (flagged)
    estart, pstart = ends - padded, _exclusive(n, 0)  # group starts; source p's start within a group
    j = torch.arange(rows, device=dev)
    e = torch.searchsorted(ends, j, right=True).clamp(max=nl - 1)
    r = j - estart[e]
    p = torch.searchsorted(torch.cumsum(n, 0).T[e].contiguous(), r[:, None], right=True).squeeze(1).clamp(max=world - 1)
    src = p * cap + off[p, e] + (r - pstart[p, e])
    ok = (j < ends[-1]) & (r < tot[e]) & (src < (p + 1) * cap)
    place = torch.where(ok, src, world * cap).clamp(0, world * cap)
    i = torch.arange(cap, device=dev).expand(world, cap)
    es = torch.searchsorted(torch.cumsum(n, 1), i.contiguous(), right=True).clamp(max=nl - 1)  # [W, C]
    ps = torch.arange(world, device=dev)[:, None]
    slot = estart[es] + pstart[ps, es] + (i - off[ps, es])
    back = torch.where(i < n.sum(1, keepdim=True), slot, rows).clamp(0, rows)
    return place, ends, back.flatten()


def _plan(every: Tensor, rank: int, cap: int, align: int, rows: int) -> tuple[Tensor, ...]:
    """(send, home, place, ends, back, bad) from the gathered counts and flags [W, E + 1]: the
    indices (_dispatch_index, _expert_index) and whether the call is flagged."""
    routed = every[:, :-1]
    bad = (every[:, -1] != 0).any() | (routed.sum(1) > cap).any()
    send, home = _dispatch_index(routed, rank, cap, rows)
    place, ends, back = _expert_index(routed, rank, cap, align)
    return send, home, place, ends, back, bad


class _Replayed:
    """_plan captured once in a CUDA graph for one (shape, rank, capacity, align, rows): a call
    copies the gathered counts in, replays it and clones what it made (a later call's replay
    overwrites the graph's tensors, which autograd may still hold).  _plan is about a hundred
    small operations, each costing the host more than its kernel costs the GPU at these sizes."""

    def __init__(self, every: Tensor, key: tuple) -> None:
        self.counts = every.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = _plan(self.counts, *key)

    def __call__(self, every: Tensor) -> tuple[Tensor, ...]:
        self.counts.copy_(every)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)


_PLANS: collections.OrderedDict = collections.OrderedDict()  # key -> _Replayed, None: the capture failed
PLAN_ENTRIES = 16  # plans kept (a graph and its memory each): a server's batch sizes, the least recent dropped


def _indices(every: Tensor, key: tuple) -> tuple[Tensor, ...]:
    """_plan(every, *key): replayed from a CUDA graph on a GPU outside a capture (one replay in
    place of its operations' launches), else run as operations (a graph being captured holds
    them itself)."""
    if not every.is_cuda or torch.cuda.is_current_stream_capturing():
        return _plan(every, *key)
    full = (tuple(every.shape), every.device, *key)
    if full not in _PLANS:
        try:
            _PLANS[full] = _Replayed(every, key)
        except RuntimeError as e:  # the same shapes and ops on every rank: the same outcome
            log.warning("commopt moe sync_free: its index plan could not be captured in a CUDA graph (%s); it runs "
                        "as operations", str(e).splitlines()[0])
            _PLANS[full] = None
        while len(_PLANS) > PLAN_ENTRIES:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(full)
    plan = _PLANS[full]
    return plan(every) if plan is not None else _plan(every, *key)


def _exchange(t: Tensor, cap: int, group) -> Tensor:
    """All-to-all of equal blocks of `cap` rows (t [W * C, ...]): block p of the result is rank p's
    block for this rank; differentiable (its backward the reverse exchange)."""
    splits = [cap] * dist.get_world_size(group)
    return AllToAll.apply(t, splits, splits, group)


def sync_free(x: Tensor, counts: Tensor, weights: tuple[Tensor, Tensor, Tensor], group,
              align: int | None = None, compute_dtype: torch.dtype | None = None) -> Tensor:
    """The experts' outputs for x's rows (the module docstring), x (T, D) sorted by expert over
    all E experts with `counts` (E,) on x's device, weights this rank's (w1 (nl, H, D), w2 (nl, D,
    H), w3 (nl, H, D)); differentiable in x and the weights.  No host read of the counts.  align:
    rows per padded group (default 8 on a GPU, none elsewhere); compute_dtype: the experts and the
    exchange in this dtype, the output in x's."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    w1, w2, w3 = weights
    if counts.numel() != w1.shape[0] * world:
        raise ValueError(f"commopt moe sync_free: {counts.numel()} experts' counts for {w1.shape[0]} local experts "
                         f"over {world} ranks")
    dt = compute_dtype or x.dtype
    align = align if align is not None else (8 if x.is_cuda else 1)
    cap = -(-_capacity(group, x.shape[0], x.device) // align) * align  # whole groups of rows a block
    every = _all_counts(counts, x.shape[0], group)
    send, home, place, ends, back, bad = _indices(every, (rank, cap, align, x.shape[0]))
    _trip(group, bad)
    # every gather's backward gathers with its partner index (send / home, place / back); the
    # experts' padding rows are zero (they add nothing to a weight gradient); a flagged call's
    # outputs are NaN and its gradients zero, both written by the last gather
    got = _exchange(_picked(x.to(dt), send, home), cap, group)
    y = _GroupedSwiGLU.apply(_picked(got, place, back), *(w.to(dt) for w in (w1, w2, w3)), ends)
    return _picked(_exchange(_picked(y, back, place), cap, group), home, send, bad, float("nan")).to(x.dtype)
