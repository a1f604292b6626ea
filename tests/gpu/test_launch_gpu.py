"""kernels/gpu/launch.py on a GPU: a Triton kernel launched through its kept binary moves the same
rows as the JIT's own launch, across every change the JIT specializes on (an int becoming 1 or a
multiple of 16, a tensor's address losing its 16-byte alignment, a dtype, a constexpr), each a
binary of its own, with fresh random inputs every call."""

from __future__ import annotations

import pytest


def _reference(dst, first, second, runs):
    from torch_commopt.kernels.moe.runs import other

    want = dst.clone()
    for s, d, n in runs:
        src, at = (first, s) if s >= 0 else (second, other(s))
        want[d:d + n] = src[at:at + n]
    return want


@pytest.mark.gpu
def test_kept_binaries_move_what_the_jit_moves_across_specializations(one_gpu):
    import torch

    from torch_commopt.kernels.moe import runs_triton
    from torch_commopt.kernels.moe.runs import on_device, other, table

    launcher = runs_triton._launch_runs2  # noqa: SLF001
    gen = torch.Generator(device=one_gpu).manual_seed(3)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for width in (3, 48, 1536):  # fp32 width 3: rows 12 bytes apart, so row 1 is not 16-byte aligned
            for lead in (0, 1, 2, 5):  # runs before ours in the shared table: start 0, 1, 2, 5
                for offset in (0, 1):  # a view from row 1: aligned or not, depending on the row's bytes
                    cases.append((dtype, width, lead, offset))
    before = launcher.fast_calls
    for _ in range(2):  # the first pass compiles each key through the JIT, the second launches the kept binaries
        for dtype, width, lead, offset in cases:
            first = torch.randn(200, width, device=one_gpu, generator=gen).to(dtype)[offset:]
            second = torch.randn(300, width, device=one_gpu, generator=gen).to(dtype)[::2]
            dst = torch.randn(400, width, device=one_gpu, generator=gen).to(dtype)[offset:]
            runs = [(0, 5, 70), (other(3), 100, 20), (70, 390 - offset, 9), (other(40), 200, 110)]
            tables, _ = on_device([table([(0, 0, 1)] * lead), table(runs)], one_gpu)
            want = _reference(dst, first, second, runs)
            runs_triton.copy_runs2(dst, first, second, tables[1])
            assert torch.equal(dst, want), (dtype, width, lead, offset)
    torch.cuda.synchronize()
    assert launcher.fast_calls - before >= len(cases)  # the second pass took the kept binaries
