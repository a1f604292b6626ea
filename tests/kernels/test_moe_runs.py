"""Row runs (kernels/moe/runs.py): the run tables by_expert moves its rows by, on the CPU path and
in the Triton kernel run by Triton's CPU interpreter (tests/gpu/test_moe_gpu.py runs it on GPUs
inside by_expert)."""

from __future__ import annotations

import subprocess
import sys

import torch

from torch_commopt.kernels.moe.runs import copy_runs, on_device, table


def _by_index(dst: torch.Tensor, src: torch.Tensor, runs) -> torch.Tensor:
    """The reference: the same move by a per-row index."""
    want = dst.clone()
    for s, d, n in runs:
        want[torch.arange(d, d + n)] = src[torch.arange(s, s + n)]
    return want


def _device_rows(t) -> torch.Tensor:
    """A RunTable's rows of the tensor it shares."""
    return t.whole.view(-1, 3)[t.start: t.start + len(t.runs)]


def test_runs_move_exactly_their_rows_and_leave_the_rest():
    gen = torch.Generator().manual_seed(5)
    src, dst = torch.randn(40, 6, generator=gen), torch.randn(50, 6, generator=gen)
    runs = [(0, 10, 3), (3, 0, 0), (3, 30, 7), (10, 2, 5), (15, 45, 5)]
    (moves, more), (index,) = on_device([table(runs), table([(2, 20, 4)])], "cpu", ([7, 3, 11],))
    # one copy, every part in place
    assert index.tolist() == [7, 3, 11] and _device_rows(more).tolist() == [[2, 20, 4]] and more.whole is moves.whole
    assert _device_rows(moves).shape == (4, 3) and moves.longest == 7  # the empty run dropped
    want = _by_index(dst, src, runs)
    copy_runs(dst, src, moves)
    assert torch.equal(dst, want)


def test_a_table_of_no_runs_moves_nothing():
    (empty,), _ = on_device([table([(0, 0, 0)])], "cpu")
    dst = torch.ones(3, 2)
    copy_runs(dst, torch.zeros(3, 2), empty)
    assert torch.equal(dst, torch.ones(3, 2))


TRITON_CHECK = r"""
import torch
from torch_commopt.kernels.moe import runs_triton
from torch_commopt.kernels.moe.runs import on_device, table

gen = torch.Generator().manual_seed(9)
for width, dtype in ((48, torch.float32), (1536, torch.bfloat16)):  # one column block; two, the last part-filled
    src = torch.randn(300, width, generator=gen).to(dtype)
    dst = torch.randn(400, width, generator=gen).to(dtype)
    runs = [(0, 5, 70), (70, 100, 1), (71, 390, 10), (81, 200, 130)]
    (_, moves), _ = on_device([table([(0, 0, 2)]), table(runs)], "cpu")  # a table after another: its start is not 0
    want = dst.clone()
    for s, d, n in runs:
        want[d:d + n] = src[s:s + n]
    runs_triton.copy_runs(dst, src, moves)
    assert torch.equal(dst, want), (width, dtype)
print("ok")
"""


def test_the_triton_kernel_in_the_interpreter_moves_the_same_rows(triton_interpreter):
    res = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=triton_interpreter, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-3000:]


TRITON_CHECK2 = r"""
import torch
from torch_commopt.kernels.moe import runs_triton
from torch_commopt.kernels.moe.runs import on_device, other, table

gen = torch.Generator().manual_seed(11)
for width, dtype in ((48, torch.float32), (1536, torch.bfloat16)):
    first = torch.randn(120, width, generator=gen).to(dtype)
    second = torch.randn(300, width, generator=gen).to(dtype)[::2]  # strided rows: a view of slots
    dst = torch.randn(400, width, generator=gen).to(dtype)
    runs = [(0, 5, 70), (other(3), 100, 20), (70, 390, 10), (other(40), 200, 110)]
    (_, moves), _ = on_device([table([(0, 0, 2)]), table(runs)], "cpu")
    want = dst.clone()
    for s, d, n in runs:
        src, at = (first, s) if s >= 0 else (second, other(s))
        want[d:d + n] = src[at:at + n]
    runs_triton.copy_runs2(dst, first, second, moves)
    assert torch.equal(dst, want), (width, dtype)
print("ok")
"""


def test_two_sources_in_one_move_read_each_run_from_its_own():
    """copy_runs2, the CPU path and the Triton kernel in the interpreter: a run whose source row is
    negative reads the second source (runs.other), the others the first."""
    from torch_commopt.kernels.moe.runs import copy_runs2, other

    gen = torch.Generator().manual_seed(6)
    first, second, dst = torch.randn(20, 4, generator=gen), torch.randn(30, 4, generator=gen), torch.zeros(40, 4)
    runs = [(0, 0, 5), (other(10), 5, 8), (7, 20, 3), (other(0), 30, 2)]
    (moves,), _ = on_device([table(runs)], "cpu")
    copy_runs2(dst, first, second, moves)
    assert torch.equal(dst[:5], first[:5]) and torch.equal(dst[5:13], second[10:18])
    assert torch.equal(dst[20:23], first[7:10]) and torch.equal(dst[30:32], second[:2])
    assert not dst[13:20].any() and not dst[23:30].any() and not dst[32:].any()


def test_the_two_source_triton_kernel_in_the_interpreter_moves_the_same_rows(triton_interpreter):
    res = subprocess.run([sys.executable, "-c", TRITON_CHECK2], env=triton_interpreter, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-3000:]
