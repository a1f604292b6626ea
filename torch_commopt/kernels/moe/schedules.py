"""Expert-parallel schedules: a rank's routed tokens through the experts of every rank and back.

`expert_parallel(x, counts, experts, group, schedule)` takes a rank's routed tokens x (T, D) sorted by
expert over all E experts, `counts` (E,) the tokens per expert, and `experts(rows, per_expert)` the
rank's local experts applied to expert-major rows with `per_expert` (nl,) rows each (a
GroupedExperts-like callable).  It returns the experts' outputs (T, D) in x's row order, and is
differentiable in x and in whatever `experts` uses (its weights).

Schedules (reference implementations, any backend; exchange.py has the transfers):
- `a2a`: torchtitan's expert parallelism.  All tokens to their experts' ranks in one all-to-all,
  reordered from source-major to expert-major, the experts over all of them in one call,
  reordered back, all outputs home in a second all-to-all.  Nothing overlaps the exchanges.
- `by_peer`: one peer at a time around the ring.  Step s sends this rank's run for rank r+s and
  receives rank r-s's run for this rank; the experts run on that source's rows alone; the outputs
  go back to r-s while r+s's come home.  Step 0 is this rank's own tokens, which need no transfer.
  The forward posts each step's tokens before the previous step's experts run and waits for the
  outputs' trips home only at the end, so on a backend whose transfers progress on their own
  (NCCL's stream on a GPU, gloo's threads on CPU) they move under the experts' compute.  Its
  backward swaps each gradient back with one posted-and-waited transfer per step, in autograd's
  order, which is the same on every rank.  On a GPU each expert's GEMMs shrink to a source's rows
  and its weight gradient is summed over the pieces, which costs the compute more than by_expert
  (benchmarks/results/moe_pieces_*).
- `by_expert[:C]`: the exchange in C chunks of experts, pipelined both ways (by_expert.py).  It
  runs the experts itself (GroupedExperts' SwiGLU), so it takes their `weights`.
- `sync_free`: every size on the device (sync_free.py): the counts all-gathered, never read on the
  host, equal blocks of a fixed capacity exchanged; it runs the experts itself too.

Every rank must call with the same schedule and group; the Routing's counts tell every rank how
many rows each transfer moves, so empty runs (an expert or a rank receiving nothing) move nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.core.moe_spec import parse_moe_schedule
from torch_commopt.kernels.moe.by_expert import DEFAULT_CHUNKS, by_expert, layout
from torch_commopt.kernels.moe.exchange import (
    AllToAll,
    Routing,
    counts_on,
    exchange_counts,
    finish_swap,
    gather_rows,
    inverse_of,
    post_swap,
    ranges,
)
from torch_commopt.kernels.moe.sync_free import sync_free

Experts = Callable[[Tensor, Tensor], Tensor]


def expert_parallel(x: Tensor, counts: Tensor, experts: Experts, group: dist.ProcessGroup,
                    schedule: str = "a2a", routing: Routing | None = None,
                    weights: tuple[Tensor, Tensor, Tensor] | None = None,
                    compute_dtype: torch.dtype | None = None) -> Tensor:
    """The experts' outputs for x's rows (module docstring).  routing: the call's Routing when the
    caller has it (exchange_counts otherwise: one all-to-all of the counts and a host read).
    weights: the local experts' (w1, w2, w3), which by_expert runs itself, in compute_dtype when
    given (by_expert.by_expert)."""
    try:
        name, chunks = parse_moe_schedule(schedule)
    except ValueError as e:
        raise ValueError(f"commopt moe: {e}") from e
    if name == "auto":
        raise ValueError("commopt moe: 'auto' is resolved by the tuner per call (kernels/moe/module.install with "
                         "choose=, as torch_commopt.optimize does); expert_parallel takes the schedule it picked")
    if name in ("by_expert", "sync_free") and weights is None:
        raise ValueError(f"commopt moe: {name} runs the experts' SwiGLU itself and needs their weights (w1, w2, w3)")
    if x.dim() != 2:
        raise ValueError(f"commopt moe: routed tokens must be (T, D), got shape {tuple(x.shape)}")
    if name == "sync_free":  # before any host read of the counts: it makes none
        return sync_free(x, counts, weights, group, compute_dtype=compute_dtype)
    routing = routing or exchange_counts(counts, group)
    if sum(routing.send_rows(q) for q in range(routing.world)) != x.shape[0]:
        raise ValueError(f"commopt moe: counts sum to {sum(map(sum, routing.send))} tokens, x has {x.shape[0]} rows")
    if routing.world == 1:
        return experts(x, _counts(routing.recv[0], x.device))
    if name == "by_expert":
        return by_expert(x, routing, weights, group, chunks or DEFAULT_CHUNKS, compute_dtype=compute_dtype)
    return (_a2a if name == "a2a" else _by_peer)(x, routing, experts, group)


def _counts(values, device) -> Tensor:
    return counts_on(values, device)


def expert_major(routing: Routing, device=None) -> Tensor:
    """For the rows received in source-major order (source p's run, expert-major within it), the
    source-major row of each expert-major row (an index on `device`)."""
    starts, at = [], 0
    for p in range(routing.world):
        row = []
        for e in range(routing.local_experts):
            row.append(at)
            at += routing.recv[p][e]
        starts.append(row)
    return ranges([(starts[p][e], routing.recv[p][e]) for e in range(routing.local_experts)
                   for p in range(routing.world)], device)


def _padded_place(routing: Routing, device, align: int) -> tuple[Tensor, Tensor, int]:
    """For the rows received source-major: each one's row in the padded expert-major buffer
    (by_expert.layout), its padded rows per expert on `device`, and its rows; the gathers take
    the per-row index (by_expert moves runs instead)."""
    sizes, padded, starts = layout(routing, align)
    filled, spans = list(starts), []
    for p in range(routing.world):
        for e, n in enumerate(routing.recv[p]):
            spans.append((filled[e], n))
            filled[e] += n
    return ranges(spans, device), counts_on(padded, device), sum(padded)


def a2a_exchanged(x: Tensor, routing: Routing, experts: Experts, group) -> Tensor:
    """The a2a schedule itself at any world, one rank included (expert_parallel calls the experts
    directly there): what one GPU can time of its reorders and exchanges (bench_moe --pieces)."""
    return _a2a(x, routing, experts, group)


def _a2a(x: Tensor, routing: Routing, experts: Experts, group) -> Tensor:
    world = routing.world
    sends = [routing.send_rows(q) for q in range(world)]
    recvs = [routing.recv_rows(p) for p in range(world)]
    got = AllToAll.apply(x, recvs, sends, group)
    pads = getattr(experts, "pads", None)
    if pads is not None and pads(x.device):
        # experts whose groups must be padded (module.PaddedLocal): each received row straight to
        # its place in its expert's padded group and back, one copy each way (torchtitan's count)
        # where reordering and padding apart would copy every row twice each way
        # both copies are gathers, forward and backward, with place and its inverse (the padding
        # rows: zeros): an indexed copy runs at under half the copy speed
        place, groups, rows = _padded_place(routing, x.device, experts.align)
        taken = inverse_of(place, rows)
        out = experts.unpadded(gather_rows(got, taken, inverse=place), groups)
        return AllToAll.apply(gather_rows(out, place, inverse=taken), sends, recvs, group)
    order = expert_major(routing, x.device)
    inverse = inverse_of(order, order.numel())
    out = experts(gather_rows(got, order, covers=True, inverse=inverse), _counts(routing.per_expert(), x.device))
    return AllToAll.apply(gather_rows(out, inverse, covers=True, inverse=order), sends, recvs, group)


def _by_peer(x: Tensor, routing: Routing, experts: Experts, group) -> Tensor:
    rank, world = routing.rank, routing.world

    def run_for(dst: int) -> Tensor:  # this rank's run of rows for rank dst
        lo = routing.send_offset(dst)
        return x[lo: lo + routing.send_rows(dst)]

    def dispatch(step: int):  # step's tokens posted: this rank's run for r+s, r-s's run for this rank
        dst, src = (rank + step) % world, (rank - step) % world
        return post_swap(run_for(dst), dst, src, routing.recv_rows(src), group)

    outs: list[Tensor | None] = [None] * world
    coming = dispatch(1)  # in flight while this rank's own rows go through the experts
    outs[rank] = experts(run_for(rank), _counts(routing.recv[rank], x.device))
    homes = []
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        rows = finish_swap(*coming)
        if step + 1 < world:
            coming = dispatch(step + 1)  # the next source's tokens move while this one's compute
        y = experts(rows, _counts(routing.recv[src], x.device))
        homes.append((dst, post_swap(y, src, dst, routing.send_rows(dst), group)))  # outputs home, posted
    for dst, (buf, pending) in homes:
        outs[dst] = finish_swap(buf, pending)
    return torch.cat(outs)
