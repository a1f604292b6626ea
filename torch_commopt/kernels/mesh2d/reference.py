"""The reference 2D GEMMs on an R x C device mesh (plain torch + c10d): MeshSlice's sliced
dataflows, the Collective 2D GEMM and SUMMA (all three dataflows); the FC layer's forward and
backward built from them.

Every operand is sharded over both mesh axes, P(row, col): rank (i, j) holds block (i, j) of each
2D operand; `rows` is the group along mesh dim 0 (the R ranks of column j) and `cols` the group
along dim 1 (the C ranks of row i), as torch's DeviceMesh.get_group(0) / (1) give them.

    os  Y = X W     X [M, K], W [K, N]: slice s of K all-gathered -- X's along cols, W's along
                    rows -- and multiplied into Y, which stays
    ls  Y = X W^T   X [M, K] stays, W stored [N, K]: slice s of N of W all-gathered along rows,
                    X W_s^T reduce-scattered along cols into Y's slice s
    rs  Y = X^T W   X stored [K, M], W [K, N] stays: slice s of M of X all-gathered along cols,
                    X_s^T W reduce-scattered along rows into Y's slice s

Slices interleave: slice s of a sharded dimension is the positions p with p % S == s.  With every
shard a multiple of S long, slice s gathered over an axis in rank
order is the same global positions, ascending, whichever axis holds the dimension -- which is what
makes X's and W's gathered K-slices meet, and a reduce-scatter's chunk land in its owner's block.
Slice s + 1's all-gathers are in flight while slice s multiplies; S = 1 is the Collective 2D
GEMM (whole-shard collectives, then one GEMM).

Per-axis schedules (`axis_schedule`, ls and rs): each slice's GEMM and its reduce-scatter run as
one `commopt.matmul_rs` call on the reducing axis's group with that schedule -- the 1-D GPU
schedules (copy-engine pushes on symmetric memory, the GEMM in pieces beside them) on CUDA, their
reference twins elsewhere -- while the next slice's all-gather is in flight on the other axis.
ls's reduce-scatter runs along Y's columns, which the 1-D op does not cut, so it multiplies the
transposed product (W_s X^T, scattered along its rows) and places each block transposed.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from torch_commopt.kernels.collectives import all_gather, reduce_scatter


def _cut(x: Tensor, dim: int, slices: int) -> Tensor:
    """x with `dim` split into (n / slices, slices): slice s is index s of the new dim + 1."""
    n = x.shape[dim]
    if n % slices:
        raise ValueError(f"mesh2d: a shard of {n} does not cut into {slices} slices")
    return x.view(list(x.shape[:dim]) + [n // slices, slices] + list(x.shape[dim + 1:]))


def _slice(x: Tensor, dim: int, s: int, slices: int) -> Tensor:
    """Positions p of `dim` with p % slices == s, in order."""
    return _cut(x.contiguous(), dim, slices).select(dim + 1, s)


def _place(out: Tensor, dim: int, s: int, slices: int, piece: Tensor) -> None:
    """out's slice s of `dim` (as _slice cuts it) = piece."""
    _cut(out, dim, slices).select(dim + 1, s).copy_(piece)


def _check(kind: str, slices: int, rows, cols) -> None:
    if kind not in ("os", "ls", "rs"):
        raise ValueError(f"mesh2d: unknown dataflow {kind!r} (os, ls, rs)")
    if slices < 1:
        raise ValueError(f"mesh2d: {slices} slices")
    if rows is None or cols is None:
        raise ValueError("mesh2d: a 2D GEMM needs the row and the col group")


def _matmul_rs(a: Tensor, w: Tensor, group: dist.ProcessGroup, schedule: str):
    """a @ w reduce-scattered (sum) along its rows over `group` by the 1-D op with `schedule`:
    an object with the reduce-scatter's `wait()` (the op has returned it done)."""
    out = torch.ops.commopt.matmul_rs(a, w, None, 0, "sum", group.size(), group.group_name, schedule)
    return _Done(out)


class _Done:
    """A finished collective's result behind c10d's `wait()`, so both kinds of slice read alike."""

    def __init__(self, value: Tensor):
        self.value = value

    def wait(self) -> Tensor:
        return self.value


def gemm_2d(kind: str, a: Tensor, b: Tensor, rows: dist.ProcessGroup, cols: dist.ProcessGroup, slices: int = 1,
            gathered: Tensor | None = None, axis_schedule: str = "") -> Tensor:
    """This rank's block of the 2D GEMM `kind` (module docstring) of the blocks a and b, in
    `slices` pipelined slices.  gathered (rs only): filled with X's rows gathered along cols,
    [M, K/R] (Xᵀ's slices as they arrive, transposed: what a program that gathers X whole keeps
    for its backward).  axis_schedule (ls, rs; "": c10d's reduce-scatter): each slice's GEMM and
    reduce-scatter as one 1-D `matmul_rs` with this schedule (module docstring)."""
    _check(kind, slices, rows, cols)
    if axis_schedule and kind == "os":
        raise ValueError("mesh2d: os reduces nothing; a per-axis schedule is for ls and rs")
    if gathered is not None and kind != "rs":
        raise ValueError(f"mesh2d: only rs hands back its gathered operand, not {kind}")
    if kind == "os":  # a = X [M/R, K/C], b = W [K/R, N/C]
        def fetch(s):
            return (all_gather(_slice(a, 1, s, slices), 1, cols, async_op=True),
                    all_gather(_slice(b, 0, s, slices), 0, rows, async_op=True))
        pending = fetch(0)
        if slices == 1:  # the Collective 2D GEMM: one product
            xs, ws = (p.wait() for p in pending)
            return xs @ ws
        # the slices' partial products summed in float32 for 16-bit operands (one GEMM accumulates
        # its K in float32; S additions in bf16 would add S roundings)
        acc = torch.float32 if a.dtype in (torch.bfloat16, torch.float16) else a.dtype
        out = a.new_zeros(a.shape[0], b.shape[1], dtype=acc)
        for s in range(slices):
            xs, ws = (p.wait() for p in pending)
            if s + 1 < slices:
                pending = fetch(s + 1)
            out += (xs @ ws).to(acc)
        return out.to(a.dtype)
    if kind == "ls":  # a = X [M/R, K/C], b = W [N/R, K/C]
        out = a.new_empty(a.shape[0], b.shape[0] * rows.size() // cols.size())
        pending, scattered = all_gather(_slice(b, 0, 0, slices), 0, rows, async_op=True), []
        for s in range(slices):
            ws = pending.wait()
            if s + 1 < slices:
                pending = all_gather(_slice(b, 0, s + 1, slices), 0, rows, async_op=True)
            scattered.append(_matmul_rs(ws, a.T, cols, axis_schedule) if axis_schedule
                             else reduce_scatter(a @ ws.T, 1, "sum", cols, async_op=True))
        for s, p in enumerate(scattered):
            _place(out, 1, s, slices, p.wait().T if axis_schedule else p.wait())
        return out
    # rs: a = X stored [K/R, M/C], b = W [K/R, N/C]
    out = b.new_empty(a.shape[1] * cols.size() // rows.size(), b.shape[1])
    pending, scattered = all_gather(_slice(a, 1, 0, slices), 1, cols, async_op=True), []
    for s in range(slices):
        xs = pending.wait()
        if s + 1 < slices:
            pending = all_gather(_slice(a, 1, s + 1, slices), 1, cols, async_op=True)
        if gathered is not None:
            _place(gathered, 0, s, slices, xs.T)
        scattered.append(_matmul_rs(xs.T, b, rows, axis_schedule) if axis_schedule
                         else reduce_scatter(xs.T @ b, 0, "sum", rows, async_op=True))
    for s, p in enumerate(scattered):
        _place(out, 0, s, slices, p.wait())
    return out


def _panel(x: Tensor, dim: int, t: int, per: int, mine: bool) -> Tensor:
    """Panel t of dim (one of the `per` panels a rank's block holds) if this rank holds it, else an
    empty tensor of its shape to receive it."""
    width = x.shape[dim] // per
    if mine:
        return x.narrow(dim, (t % per) * width, width).contiguous()
    shape = list(x.shape)
    shape[dim] = width
    return x.new_empty(shape)


def summa(kind: str, a: Tensor, b: Tensor, rows: dist.ProcessGroup, cols: dist.ProcessGroup) -> Tensor:
    """SUMMA in lcm(R, C) steps over panels of the dimension `kind`'s collectives carry, panel t + 1's
    collectives in flight while panel t multiplies:
        os  K panels of X broadcast along cols and of W along rows, multiplied into Y;
        ls  N panels of W broadcast along rows, X W_t^T reduced along cols to the panel's owner;
        rs  M panels of X broadcast along cols, X_t^T W reduced along rows to the panel's owner."""
    _check(kind, 1, rows, cols)
    r, c = rows.size(), cols.size()
    steps = math.lcm(r, c)
    me_row, me_col = rows.rank(), cols.rank()
    if kind == "os":  # a = X [M/R, K/C], b = W [K/R, N/C]
        per_x, per_w = steps // c, steps // r
        if a.shape[1] % per_x or b.shape[0] % per_w or a.shape[1] // per_x != b.shape[0] // per_w:
            raise ValueError(f"mesh2d SUMMA: K blocks {a.shape[1]} / {b.shape[0]} do not cut into {steps} panels")

        def fetch(t):
            ox, ow = t // per_x, t // per_w
            xp, wp = _panel(a, 1, t, per_x, ox == me_col), _panel(b, 0, t, per_w, ow == me_row)
            return xp, wp, [dist.broadcast(xp, dist.get_global_rank(cols, ox), group=cols, async_op=True),
                            dist.broadcast(wp, dist.get_global_rank(rows, ow), group=rows, async_op=True)]
        out = a.new_zeros(a.shape[0], b.shape[1])
        pending = fetch(0)
        for t in range(steps):
            xp, wp, works = pending
            for w in works:
                w.wait()
            if t + 1 < steps:
                pending = fetch(t + 1)
            out += xp @ wp
        return out
    # ls: a = X [M/R, K/C], b = W [N/R, K/C], out [M/R, N/C];  rs: a = X [K/R, M/C], b = W [K/R, N/C]
    moving, along, mover = (b, rows, me_row) if kind == "ls" else (a, cols, me_col)
    into, owners, owner_me = (cols, c, me_col) if kind == "ls" else (rows, r, me_row)
    dim_in = 0 if kind == "ls" else 1  # the panel's dimension in the moving operand
    per_in, per_out = steps // along.size(), steps // owners
    if kind == "ls":
        out = a.new_empty(a.shape[0], b.shape[0] * r // c)
    else:
        out = b.new_empty(a.shape[1] * c // r, b.shape[1])
    dim_out = 1 if kind == "ls" else 0

    def fetch(t):
        owner = t // per_in
        p = _panel(moving, dim_in, t, per_in, owner == mover)
        return p, dist.broadcast(p, dist.get_global_rank(along, owner), group=along, async_op=True)
    pending, reduced = fetch(0), []
    for t in range(steps):
        p, work = pending
        work.wait()
        if t + 1 < steps:
            pending = fetch(t + 1)
        part = (a @ p.T) if kind == "ls" else (p.T @ b)
        owner = t // per_out
        reduced.append((t, owner, part, dist.reduce(part, dist.get_global_rank(into, owner), group=into,
                                                    async_op=True)))
    width = out.shape[dim_out] // per_out
    for t, owner, part, work in reduced:
        work.wait()
        if owner == owner_me:
            out.narrow(dim_out, (t % per_out) * width, width).copy_(part)
    return out


def _gemm(kind: str, a: Tensor, b: Tensor, rows, cols, slices: int) -> Tensor:
    """MeshSlice's sliced GEMM, or SUMMA where slices is 0."""
    return summa(kind, a, b, rows, cols) if slices == 0 else gemm_2d(kind, a, b, rows, cols, slices)


# (dataflow, transposed) -> the FC layer's forward, dX and dW GEMMs, each (kind, left, right) of
# the stored operands x, w and dy (dy stored as the layer's output is), as the paper pairs them and
# tuner/mesh2d/model.py prices them (_LAYER_GEMMS, the same order and dimensions).  Stored forms:
#   os  x [T, I], w [I, O] -> y [T, O]        os^T  x [I, T], w [O, I] -> y [O, T]
#   ls  x [T, I], w [O, I] -> y [T, O]        ls^T  x [I, T], w [I, O] -> y [O, T]
#   rs  x [I, T], w [I, O] -> y [T, O]        rs^T  x [T, I], w [O, I] -> y [O, T]
# (^T: the activations stored transposed, as a transposed dataflow hands them on to the next layer)
FC_GEMMS = {
    ("os", False): (("os", "x", "w"), ("ls", "dy", "w"), ("rs", "x", "dy")),
    ("ls", False): (("ls", "x", "w"), ("os", "dy", "w"), ("rs", "dy", "x")),
    ("rs", False): (("rs", "x", "w"), ("ls", "w", "dy"), ("os", "x", "dy")),
    ("os", True): (("os", "w", "x"), ("rs", "w", "dy"), ("ls", "dy", "x")),
    ("ls", True): (("rs", "w", "x"), ("os", "w", "dy"), ("ls", "x", "dy")),
    ("rs", True): (("ls", "w", "x"), ("rs", "dy", "w"), ("os", "dy", "x")),
}


def stored_shapes(dataflow: str, transposed: bool, tokens: int, in_features: int,
                  out_features: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The whole x, w and y of an FC layer as FC_GEMMS stores them for (dataflow, transposed)."""
    dims = {"B": tokens, "I": in_features, "O": out_features}
    x = {("os", False): "BI", ("ls", False): "BI", ("rs", False): "IB",
         ("os", True): "IB", ("ls", True): "IB", ("rs", True): "BI"}[(dataflow, transposed)]
    w = "OI" if (dataflow == "ls") != transposed else "IO"
    y = "OB" if transposed else "BO"
    return tuple(tuple(dims[c] for c in letters) for letters in (x, w, y))


class FCLayer2D(torch.autograd.Function):
    """An FC layer in one of MeshSlice's dataflows (FC_GEMMS: its stored forms and its three
    GEMMs), every operand's block P(row, col), each GEMM in `slices` slices (0: SUMMA)."""

    @staticmethod
    def forward(ctx, x, w, dataflow: str, transposed: bool, rows, cols, slices: int):
        ctx.save_for_backward(x, w)
        ctx.meta = (FC_GEMMS[(dataflow, transposed)], rows, cols, slices)
        kind, left, right = ctx.meta[0][0]
        ops = {"x": x, "w": w}
        return _gemm(kind, ops[left], ops[right], rows, cols, slices)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        gemms, rows, cols, slices = ctx.meta
        ops = {"x": x, "w": w, "dy": dy.contiguous()}
        dx, dw = (_gemm(kind, ops[left], ops[right], rows, cols, slices) for kind, left, right in gemms[1:])
        return dx, dw, None, None, None, None, None


def fc_2d(x: Tensor, w: Tensor, dataflow: str, rows, cols, slices: int = 1, transposed: bool = False) -> Tensor:
    """An FC layer on the mesh (FCLayer2D), differentiable; x and w stored as FC_GEMMS says for
    (dataflow, transposed); slices 0 runs its three GEMMs by SUMMA."""
    _check(dataflow, max(slices, 1), rows, cols)
    return FCLayer2D.apply(x, w, dataflow, bool(transposed), rows, cols, slices)
