"""The fused AG+GEMM consumer kernels on one GPU (kernels/gpu/ag_matmul.launch_fused): the peer
slots filled locally and their flags set beforehand, so the kernel's indexing, tile order,
bias, several B's, the 3-D row mapping and both load paths (pointers, TMA) are checked
without a second GPU.  Fresh random inputs; tolerance relative to cuBLAS's own error against
an fp32 product."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.validate import rel_err, within_tolerance

FLAG_BASE = 1024


def _run(one_gpu, *, world, m_loc, k, ns, lin=None, bias=False, kmajor=True, dtype=torch.bfloat16, tma=1, seed=0):
    from torch_commopt.kernels.gpu.ag_matmul import launch_fused

    gen = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)  # noqa: E731
    rank, lin = 1 % world, lin or m_loc
    a2, slots2 = mk(m_loc, k), mk(world * m_loc, k)
    ws = [mk(n, k).t() / k ** 0.5 if kmajor else mk(k, n) / k ** 0.5 for n in ns]
    bs = [mk(n) if bias else None for n in ns]
    flags = torch.zeros(FLAG_BASE + (world + 1) * 256, dtype=torch.int32, device="cuda")
    flags[FLAG_BASE: FLAG_BASE + world * 256] = 1
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    outer = m_loc // lin
    outs = [torch.empty(world * m_loc, n, device="cuda", dtype=dtype) for n in ns]
    launch_fused(a2, slots2, flags, status, ws, bs, outs, lin=lin, rank=rank, world=world, chunk_rows=max(1, m_loc // 3),
                 flag_base=FLAG_BASE, params={"tma": tma, "bm": 128, "bn": 128, "bk": 64, "warps": 4, "stages": 3})
    shards = [a2 if s == rank else slots2[s * m_loc:(s + 1) * m_loc] for s in range(world)]
    # gathered rows (outer, world, lin): block s of outer block o is rank s's rows o*lin..o*lin+lin
    gathered = torch.stack([sh.view(outer, lin, k) for sh in shards], dim=1).reshape(-1, k)
    for out, w, b in zip(outs, ws, bs):
        truth = gathered.float() @ w.float() + (b.float() if b is not None else 0)
        cublas = torch.mm(gathered, w) + (b if b is not None else 0)
        assert within_tolerance(rel_err(out, truth), rel_err(cublas, truth)), (rel_err(out, truth), rel_err(cublas, truth))
    assert int(status[0]) == 0


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("kmajor", [True, False])
def test_fused_kernel_matches_cublas(one_gpu, tma, kmajor):
    _run(one_gpu, world=2, m_loc=1024, k=512, ns=[768], kmajor=kmajor, tma=tma)


@pytest.mark.parametrize("tma", [0, 1])
def test_fused_kernel_ragged_shapes_three_weights_bias_3d(one_gpu, tma):
    """Sizes that are not tile multiples, q/k/v-style three B's with biases, rows of a 3-D
    gather (3 outer blocks of 111 rows per rank), fp16, world 4."""
    _run(one_gpu, world=4, m_loc=333, k=520, ns=[1000, 136, 264], lin=111, bias=True, dtype=torch.float16, tma=tma,
         seed=3)


def test_fused_tma_small_shard(one_gpu):
    """A shard smaller than one tile (TMA boxes beyond the tensor read zeros)."""
    _run(one_gpu, world=2, m_loc=40, k=64, ns=[48], tma=1, seed=5)
