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


def _padded_reference(src, index, flag, fill):
    """gather_padded's meaning, row by row."""
    out = torch.zeros((index.numel(),) + tuple(src.shape[1:]), dtype=src.dtype)
    for i, j in enumerate(index.tolist()):
        if 0 <= j < src.shape[0]:
            out[i] = src[j]
    return torch.full_like(out, fill) if flag else out


def test_padded_gather_picks_rows_zeros_empty_slots_and_fills_a_flagged_call():
    from torch_commopt.kernels.moe.runs import gather_padded

    gen = torch.Generator().manual_seed(3)
    src = torch.randn(30, 5, generator=gen)
    index = torch.randperm(40, generator=gen)[:35].clamp(max=30)  # rows of src and the empty slot (30)
    for flag in (None, torch.tensor(False), torch.tensor(True)):
        got = gather_padded(src, index, flag, float("nan"))
        want = _padded_reference(src, index, flag is not None and bool(flag), float("nan"))
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), flag
    assert torch.equal(gather_padded(src[:0], index[:4]), torch.zeros(4, 5))  # no rows at all: zeros


def test_gathered_rows_with_an_inverse_give_the_gradient_the_indexed_copy_gives():
    from torch_commopt.kernels.moe.exchange import gather_rows, inverse_of

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(20, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(20, generator=gen)[:14]  # 6 rows of x picked by none
    padded = torch.cat([index, torch.full((3,), 20)])  # and 3 empty slots (zero rows)
    grad = torch.randn(17, 3, generator=gen, dtype=torch.float64)
    out = gather_rows(x, padded, inverse=inverse_of(padded, 20))
    out.backward(grad)
    want = torch.zeros_like(x)
    want[index] = grad[:14]
    assert torch.equal(out[:14], x[index]) and torch.equal(out[14:], torch.zeros(3, 3, dtype=torch.float64))
    assert torch.equal(x.grad, want)
    assert torch.equal(inverse_of(index, 20)[index], torch.arange(14)) and (inverse_of(index, 20) == 14).sum() == 6


TRITON_GATHER = r"""
import torch
from torch_commopt.kernels.moe import runs_triton

gen = torch.Generator().manual_seed(12)
for width, dtype in ((48, torch.float32), (1536, torch.bfloat16)):
    src = torch.randn(90, width, generator=gen).to(dtype)
    index = torch.randint(0, 95, (130,), generator=gen)  # past 89: no row, a zero row
    for flag in (None, torch.tensor([False]), torch.tensor([True])):
        dst = torch.randn(130, width, generator=gen).to(dtype)
        runs_triton.gather_padded(dst, src, index, flag, float("nan"))
        want = torch.where((index < 90)[:, None], src[index.clamp(max=89)], torch.zeros((), dtype=dtype))
        if flag is not None and bool(flag):
            want = torch.full_like(want, float("nan"))
        assert torch.equal(dst.isnan(), want.isnan()) and torch.equal(dst.nan_to_num(), want.nan_to_num()), (width, flag)
print("ok")
"""


def test_the_padded_gather_kernel_in_the_interpreter_gives_the_same_rows(triton_interpreter):
    res = subprocess.run([sys.executable, "-c", TRITON_GATHER], env=triton_interpreter, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-3000:]
