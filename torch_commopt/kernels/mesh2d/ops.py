"""`torch.ops.commopt.gemm_2d`: one 2D GEMM of an R x C mesh as a graph op (passes/matmul/gemm_2d.py
puts it where a program's per-axis all-gathers feed a matmul), run by the reference schedules
(reference.py): MeshSlice's sliced GEMM in `slices` slices, 1 being the Collective 2D GEMM, 0 SUMMA.

    gemm_2d(a, b, kind, slices, rows, cols, rows_group, cols_group, return_gathered, axis_schedule)
        -> [this rank's block of the product] (+ [the gathered operand], rs with return_gathered)

kind os, ls or rs (reference.py's module docstring: the stored forms of a and b); rows / cols: the
mesh's sizes (R ranks along dim 0, C along dim 1), whose groups are rows_group (this rank's column:
the R ranks along dim 0) and cols_group (its row: the C ranks along dim 1); axis_schedule (ls and
rs, "": c10d's collectives): a `matmul_rs` schedule that each slice's GEMM and reduce-scatter run
as, on the reducing axis (reference.py).
"""

from __future__ import annotations

import torch

from torch_commopt.core.groups import resolve_group
from torch_commopt.core.schedule import Schedule
from torch_commopt.kernels.mesh2d import reference

# A fragment of the commopt namespace (kernels/matmul/ops.py holds its DEF library); plain
# torch.library.Library as there: no autograd formula (the op sits in compiled forward and
# inference graphs, after AOT autograd).
_LIB = torch.library.Library("commopt", "FRAGMENT")
_LIB.define("gemm_2d(Tensor a, Tensor b, str kind, int slices, int rows, int cols, str rows_group, "
            "str cols_group, bool return_gathered=False, str axis_schedule=\"\") -> Tensor[]")


def out_shape(kind: str, a_shape, b_shape, rows: int, cols: int) -> list[int]:
    """This rank's block of the product of blocks a and b (reference.py's stored forms)."""
    if kind == "os":  # X [M/R, K/C] W [K/R, N/C] -> [M/R, N/C]
        return [a_shape[0], b_shape[1]]
    if kind == "ls":  # X [M/R, K/C] W [N/R, K/C] -> [M/R, N/C]
        return [a_shape[0], b_shape[0] * rows // cols]
    if kind == "rs":  # X [K/R, M/C] W [K/R, N/C] -> [M/R, N/C]
        return [a_shape[1] * cols // rows, b_shape[1]]
    raise ValueError(f"commopt gemm_2d: unknown dataflow {kind!r} (os, ls, rs)")


def gathered_shape(kind: str, a_shape, cols: int) -> list[int]:
    """rs's gathered operand as the program holds it: X's rows [M, K/R] (a = Xᵀ [K/R, M/C])."""
    if kind != "rs":
        raise ValueError(f"commopt gemm_2d: only rs returns its gathered operand, not {kind!r}")
    return [a_shape[1] * cols, a_shape[0]]


def axis_schedule_error(kind: str, slices: int, axis_schedule: str) -> str | None:
    """Why `axis_schedule` cannot run this 2D GEMM (None: it can)."""
    if not axis_schedule:
        return None
    if kind == "os" or slices == 0:
        return f"a per-axis schedule runs ls and rs sliced GEMMs, not {'SUMMA' if slices == 0 else 'os'}"
    try:
        sched = Schedule.parse(axis_schedule)
    except ValueError as e:
        return str(e)
    if not sched.valid_for("matmul_rs"):
        return f"{axis_schedule!r} is not a matmul_rs schedule"
    return None


def gemm_2d(a: torch.Tensor, b: torch.Tensor, kind: str, slices: int, rows: int, cols: int, rows_group: str,
            cols_group: str, return_gathered: bool = False, axis_schedule: str = "") -> list[torch.Tensor]:
    why = axis_schedule_error(kind, slices, axis_schedule)
    if why is not None:
        raise ValueError(f"commopt gemm_2d: axis_schedule {axis_schedule!r}: {why}")
    r, c = resolve_group(rows_group), resolve_group(cols_group)
    if (r.size(), c.size()) != (rows, cols):
        raise ValueError(f"commopt gemm_2d: groups {rows_group} / {cols_group} hold {r.size()} / {c.size()} ranks, "
                         f"the op was built for a {rows} x {cols} mesh")
    a, b = a.contiguous(), b.contiguous()
    gathered = a.new_empty(gathered_shape(kind, a.shape, cols)) if return_gathered else None
    if slices == 0:
        if gathered is not None:
            raise ValueError("commopt gemm_2d: SUMMA does not hand back a gathered operand")
        return [reference.summa(kind, a, b, r, c)]
    out = reference.gemm_2d(kind, a, b, r, c, slices, gathered=gathered, axis_schedule=axis_schedule)
    return [out] if gathered is None else [out, gathered]


_LIB.impl("gemm_2d", gemm_2d, "CompositeExplicitAutograd")


@torch.library.register_fake("commopt::gemm_2d")
def _gemm_2d_fake(a, b, kind, slices, rows, cols, rows_group, cols_group, return_gathered=False, axis_schedule=""):
    out = [a.new_empty(out_shape(kind, a.shape, b.shape, rows, cols))]
    return out + ([a.new_empty(gathered_shape(kind, a.shape, cols))] if return_gathered else [])
