"""The fused GEMM kernels' arguments on one GPU, with local stand-ins for the peers and every
arrival flag set beforehand: what the one-GPU kernel tests (tests/gpu/test_fused_gemm_one_gpu.py)
check against cuBLAS and what the throughput probe (benchmarks/probe_fused_gemm.py) times, so
a kernel's GEMM is seen alone, without a second GPU and without waiting on a transfer.

- all-gather + GEMM (kernels/matmul/gpu/ag_matmul.launch_fused): this rank's shard and the peers'
  slots filled with random rows, each slot's piece flags raised;
- GEMM + reduce-scatter (kernels/matmul/gpu/matmul_reduce.launch_rs_fused): the peers' partials
  already in the receive slots, the peers' buffers and flag arrays local tensors, the counters
  (direct stores) or the copy engine's DATA flags (store=ce) already at their final values."""

from __future__ import annotations

from typing import NamedTuple

import torch

AG_FLAG_BASE = 1024  # where the all-gather's piece flags start in the stand-in flag array


class AgStandins(NamedTuple):
    a2: torch.Tensor  # this rank's shard (m_loc, K)
    slots2: torch.Tensor  # every rank's slot (world * m_loc, K), this rank's unused
    products: object  # ag_matmul.Products
    arrivals: object  # ag_matmul.Arrivals, every piece landed
    weights: list
    biases: list


class RsStandins(NamedTuple):
    a2: torch.Tensor  # (world * m_seg, K), segment s block s of every outer block of lin rows
    weight: torch.Tensor
    targets: object  # matmul_reduce.RsTargets
    signals: object  # matmul_reduce.RsSignals
    segments: object  # matmul_reduce.RsSegments
    recv: torch.Tensor  # the peers' partials, landed (world, m_seg, N)
    peer_bufs: list  # each peer's receive buffer (direct stores land in peer_bufs[s][rank])
    send: torch.Tensor  # the copy engine's send buffer (store=ce)
    flags: torch.Tensor
    peer_flags: list


class Standin(NamedTuple):
    """How the stand-ins are made: the group's size, each rank's rows in runs of `lin` (its whole
    shard or segment by default), the weights K-major (nn.Linear's) or not, the dtype and the
    generator of the random values."""

    world: int
    lin: int | None = None
    kmajor: bool = True
    dtype: torch.dtype = torch.bfloat16
    gen: torch.Generator | None = None


def _maker(dtype, gen):
    return lambda *s: torch.randn(*s, device="cuda", generator=gen).to(dtype)


def weight(n: int, k: int, kmajor: bool, mk) -> torch.Tensor:
    """A (K, N) weight scaled to keep the products near unit size; kmajor: stored (N, K), as an
    nn.Linear's weight, and transposed."""
    return mk(n, k).t() / k ** 0.5 if kmajor else mk(k, n) / k ** 0.5


def ag_standins(m_loc: int, k: int, ns: list, how: Standin, bias: bool = False) -> AgStandins:
    """launch_fused's arguments for rank 1 % world: a shard of m_loc rows (runs of lin), the
    products against one weight per entry of ns, every piece of every slot landed."""
    from torch_commopt.kernels.matmul.gpu.ag_matmul import Arrivals, Products

    world, kmajor, dtype = how.world, how.kmajor, how.dtype
    mk = _maker(dtype, how.gen)
    rank, lin = 1 % world, how.lin or m_loc
    a2, slots2 = mk(m_loc, k), mk(world * m_loc, k)
    ws = [weight(n, k, kmajor, mk) for n in ns]
    bs = [mk(n) if bias else None for n in ns]
    flags = torch.zeros(AG_FLAG_BASE + (world + 1) * 256, dtype=torch.int32, device="cuda")
    flags[AG_FLAG_BASE: AG_FLAG_BASE + world * 256] = 1
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    outs = [torch.empty(world * m_loc, n, device="cuda", dtype=dtype) for n in ns]
    arrivals = Arrivals(flags, status, AG_FLAG_BASE, rank, world, lin, max(1, m_loc // 3))
    return AgStandins(a2, slots2, Products(ws, bs, outs), arrivals, ws, bs)


def rs_standins(m_seg: int, k: int, n: int, how: Standin, direct: bool = True, bm: int = 128,
                bases_aligned: bool = True) -> RsStandins:
    """launch_rs_fused's arguments for rank 1 % world: A of world segments of m_seg rows (runs of
    lin), the peers' partials landed; the flag counts per chunk of ceil(tiles_m / 3) row tiles
    of bm rows (the kernel's params must use the same bm)."""
    from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS
    from torch_commopt.kernels.matmul.gpu.layout import cdiv
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import RsSegments, RsSignals, RsTargets

    world, dtype = how.world, how.dtype
    mk = _maker(dtype, how.gen)
    rank, lin = 1 % world, how.lin or m_seg
    a2, w = mk(world * m_seg, k), weight(n, k, how.kmajor, mk)
    recv = mk(world, m_seg, n)
    peer_bufs = [torch.zeros(world, m_seg, n, device="cuda", dtype=dtype) for _ in range(world)]
    flag_len = COUNTERS + world * MAX_CHUNKS
    flags = torch.zeros(flag_len, dtype=torch.int32, device="cuda")
    peer_flags = [torch.zeros(flag_len, dtype=torch.int32, device="cuda") for _ in range(world)]
    for src in range(world):  # every partial this rank waits for has arrived
        if src != rank and direct:  # the peers' tile counts of this rank's segment
            flags[COUNTERS + src * MAX_CHUNKS: COUNTERS + (src + 1) * MAX_CHUNKS] = 1 << 20
        elif src != rank:  # the copy engine's DATA flags (data_base 0) at epoch 1
            flags[src * MAX_CHUNKS: (src + 1) * MAX_CHUNKS] = 1
    send = torch.zeros(world, m_seg, n, device="cuda", dtype=dtype)
    out = torch.empty(m_seg, n, device="cuda", dtype=dtype)
    bases = [(recv if s == rank else peer_bufs[s]).data_ptr() for s in range(world)]
    recv_bases = torch.tensor(bases, dtype=torch.int64, device="cuda")
    flag_bases = torch.tensor([(flags if s == rank else peer_flags[s]).data_ptr() for s in range(world)],
                              dtype=torch.int64, device="cuda")
    status = torch.zeros(8, dtype=torch.int32, device="cuda")
    targets = RsTargets(out, send, recv, recv_bases, 0, direct, bases_aligned, tuple(bases))
    signals = RsSignals(flags, flag_bases, status, 0)
    segments = RsSegments(rank, world, lin, m_seg, max(1, cdiv(cdiv(m_seg, bm), 3)))
    return RsStandins(a2, w, targets, signals, segments, recv, peer_bufs, send, flags, peer_flags)
