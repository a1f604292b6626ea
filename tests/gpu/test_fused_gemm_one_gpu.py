"""The fused GEMM kernels on one GPU, with local stand-ins for the peers and their flags set
beforehand, so the kernels' indexing, tile order, row mappings and both load paths
(pointers, TMA) are checked without a second GPU:
- AG+GEMM's consumer (kernels/gpu/ag_matmul.launch_fused): the peer slots filled locally;
  bias, several B's, 3-D rows;
- GEMM+RS (kernels/gpu/matmul_reduce.launch_rs_fused): the peers' partials already in the
  receive slots, the peers' buffers and counters local tensors; both stores (direct into a
  peer's slot, or into the local send buffer for the copy engine), avg scaling, 3-D rows.
Fresh random inputs; tolerance relative to cuBLAS's own error against an fp32 product."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.testing.fused_standins import Standin, ag_standins, rs_standins
from torch_commopt.testing.validate import rel_err, within_tolerance


def _run(one_gpu, *, world, m_loc, k, ns, lin=None, bias=False, kmajor=True, dtype=torch.bfloat16, tma=1, seed=0,
         tma_store=0, flat=0):
    from torch_commopt.kernels.matmul.gpu.ag_matmul import launch_fused

    gen = torch.Generator(device="cuda").manual_seed(seed)
    st = ag_standins(m_loc, k, ns, Standin(world, lin, kmajor, dtype, gen), bias=bias)
    rank, lin = st.arrivals.rank, st.arrivals.lin
    launch_fused(st.a2, st.slots2, st.products, st.arrivals,
                 {"tma": tma, "bm": 128, "bn": 128, "bk": 64, "warps": 4, "stages": 3, "tma_store": tma_store,
                  "flat": flat})
    shards = [st.a2 if s == rank else st.slots2[s * m_loc:(s + 1) * m_loc] for s in range(world)]
    # gathered rows (outer, world, lin): block s of outer block o is rank s's rows o*lin..o*lin+lin
    gathered = torch.stack([sh.view(m_loc // lin, lin, k) for sh in shards], dim=1).reshape(-1, k)
    for out, w, b in zip(st.products.outs, st.weights, st.biases):
        truth = gathered.float() @ w.float() + (b.float() if b is not None else 0)
        cublas = torch.mm(gathered, w) + (b if b is not None else 0)
        assert within_tolerance(rel_err(out, truth), rel_err(cublas, truth)), (rel_err(out, truth), rel_err(cublas, truth))
    assert int(st.arrivals.status[0]) == 0


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


def test_fused_tma_stores_by_tma_where_a_tile_is_one_run_of_rows(one_gpu, monkeypatch):
    """tma_store=1: the TMA store (tma.out_descriptors) where every tile's rows are one run of the
    output, the pointer stores where a tile would cross into another rank's rows (lin 111 < bm
    128); both checked against cuBLAS by _run."""
    from torch_commopt.kernels.matmul.gpu import tma as tma_mod

    took, made = [], tma_mod.out_descriptors
    monkeypatch.setattr(tma_mod, "out_descriptors", lambda *a: took.append(made(*a)) or took[-1])
    _run(one_gpu, world=2, m_loc=1024, k=512, ns=[768, 256], bias=True, tma=1, seed=7, tma_store=1)
    assert took and took[-1] is not None
    _run(one_gpu, world=2, m_loc=2 * 256, k=256, ns=[384], lin=256, tma=1, seed=8, tma_store=1)  # 2 outer blocks
    assert took[-1] is not None
    _run(one_gpu, world=4, m_loc=333, k=520, ns=[1000], lin=111, dtype=torch.float16, tma=1, seed=9, tma_store=1)
    assert took[-1] is None


def _flat_taken(monkeypatch) -> list:
    """Records tma.flat_ok's answers (whether a launch ran its tiles as one pipelined loop)."""
    from torch_commopt.kernels.matmul.gpu import tma as tma_mod

    took, judge = [], tma_mod.flat_ok
    monkeypatch.setattr(tma_mod, "flat_ok", lambda *a: took.append(judge(*a)) or took[-1])
    return took


def test_fused_flat_all_gather_consumer(one_gpu, monkeypatch):
    """flat=1 (the default with tma=1): each phase one pipelined loop of tiles and k steps, flags
    awaited a tile ahead;
    several B's with biases, ragged 3-D rows at world 4, the TMA store; and a K too short for
    the pipeline (k steps <= stages), where the loops stay nested.  The other tests run flat=0."""
    took = _flat_taken(monkeypatch)
    _run(one_gpu, world=2, m_loc=1024, k=512, ns=[768, 256], bias=True, seed=11, flat=1)
    _run(one_gpu, world=4, m_loc=333, k=520, ns=[1000, 136, 264], lin=111, bias=True, dtype=torch.float16, seed=12,
         flat=1)
    _run(one_gpu, world=2, m_loc=1024, k=512, ns=[768], seed=13, tma_store=1, flat=1)
    assert took == [True, True, True]
    _run(one_gpu, world=2, m_loc=512, k=192, ns=[384], seed=14, flat=1)
    assert took[-1] is False


def test_fused_flat_is_refused_on_the_reduce_scatter(one_gpu, monkeypatch):
    """flat=1 is the all-gather consumer's option: the reduce-scatter producer refuses it."""
    with pytest.raises(ValueError, match="flat=1"):
        _run_rs(one_gpu, monkeypatch, world=2, m_seg=256, k=256, n=256, seed=15, flat=1)


def test_fused_tma_small_shard(one_gpu):
    """A shard smaller than one tile (TMA boxes beyond the tensor read zeros)."""
    _run(one_gpu, world=2, m_loc=40, k=64, ns=[48], tma=1, seed=5)


def _run_rs(one_gpu, monkeypatch, *, world, m_seg, k, n, lin=None, kmajor=True, direct=True, tma=1, alpha=1.0,
            dtype=torch.bfloat16, seed=0, want_tma=None, bases_aligned=True, flat=0):
    from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS
    from torch_commopt.kernels.matmul.gpu import tma as tma_mod
    from torch_commopt.kernels.matmul.gpu.layout import cdiv
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import launch_rs_fused

    took = []
    descriptors = tma_mod.descriptors
    monkeypatch.setattr(tma_mod, "descriptors", lambda *a, **kw: took.append(descriptors(*a, **kw)) or took[-1])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    st = rs_standins(m_seg, k, n, Standin(world, lin, kmajor, dtype, gen), direct=direct, bases_aligned=bases_aligned)
    a2, w, recv, rank, lin = st.a2, st.weight, st.recv, st.segments.rank, st.segments.lin
    outer, chunk_mt, tiles_m, tiles_n = m_seg // lin, st.segments.chunk_mt, cdiv(m_seg, 128), cdiv(n, 128)
    params = {"tma": tma, "bm": 128, "bn": 128, "bk": 64, "warps": 4, "stages": 3, "gm": 8, "flat": flat}
    launch_rs_fused(a2, w, st.targets, st.signals, st.segments, alpha, params)
    out, status, peer_bufs, send, flags, peer_flags = (st.targets.out, st.signals.status, st.peer_bufs, st.send,
                                                       st.flags, st.peer_flags)
    torch.cuda.synchronize()
    assert int(status[0]) == 0
    if want_tma is not None:
        assert (bool(took) and took[-1] is not None) == want_tma, "TMA path taken" if not want_tma else "TMA refused"
    seg_rows = [a2.view(outer, world, lin, k)[:, s].reshape(m_seg, k) for s in range(world)]
    partials = sum(recv[s].float() for s in range(world) if s != rank)
    truth = alpha * (seg_rows[rank].float() @ w.float() + partials)
    cublas = (alpha * (torch.mm(seg_rows[rank], w).float() + partials)).to(dtype)
    assert within_tolerance(rel_err(out, truth), rel_err(cublas, truth)), (rel_err(out, truth), rel_err(cublas, truth))
    tiles = [min(chunk_mt, tiles_m - c * chunk_mt) * tiles_n for c in range(cdiv(tiles_m, chunk_mt))]
    for s in range(world):
        if s == rank:
            continue
        got = peer_bufs[s][rank] if direct else send[s]
        truth_s = seg_rows[s].float() @ w.float()
        assert within_tolerance(rel_err(got, truth_s), rel_err(torch.mm(seg_rows[s], w), truth_s))
        counters = (peer_flags[s][COUNTERS + rank * MAX_CHUNKS:] if direct
                    else flags[COUNTERS + s * MAX_CHUNKS:])[:len(tiles)]
        assert counters.tolist() == tiles


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("kmajor", [True, False])
def test_fused_rs_kernel_matches_cublas(one_gpu, monkeypatch, tma, direct, kmajor):
    _run_rs(one_gpu, monkeypatch, world=2, m_seg=1024, k=512, n=768, kmajor=kmajor, direct=direct, tma=tma,
            want_tma=bool(tma))


def test_fused_rs_ragged_avg_world4(one_gpu, monkeypatch):
    """Sizes that are not tile multiples (a last tile reads the next segment's rows through
    TMA and masks them), avg scaling, fp16, world 4; direct stores with and without the
    alignment hint."""
    for aligned in (True, False):
        _run_rs(one_gpu, monkeypatch, world=4, m_seg=333, k=520, n=1000, alpha=0.25, dtype=torch.float16, seed=3,
                want_tma=True, bases_aligned=aligned)


def test_fused_rs_3d_rows(one_gpu, monkeypatch):
    """Rows of a 3-D scatter (outer blocks): TMA where each block's run is a multiple of BM,
    the pointer kernel where a tile would straddle two runs."""
    _run_rs(one_gpu, monkeypatch, world=2, m_seg=512, k=256, n=384, lin=128, seed=4, want_tma=True)
    _run_rs(one_gpu, monkeypatch, world=2, m_seg=333, k=256, n=384, lin=111, seed=5, want_tma=False)
