"""The CUDA (sm_90a) all-gather consumer (kernels/matmul/gpu/sm90.py) on one GPU, with local
stand-ins for the peers: its tile order, row mappings (runs of lin rows, ragged tiles), both
epilogues (TMA store where a warpgroup's rows are one run of the output, pointer stores
elsewhere), biases and several B's, the flag wait (a piece landing after the kernel started), the
bounded debug wait, and the logged fallback to the Triton kernel.  Fresh random inputs; tolerance
relative to cuBLAS's own error against an fp32 product."""

from __future__ import annotations

import pytest
import torch

from torch_commopt.testing.fused_standins import Standin, ag_standins
from torch_commopt.testing.validate import rel_err, within_tolerance


def _sm90(one_gpu):
    from torch_commopt.kernels.matmul.gpu import sm90

    if torch.cuda.get_device_capability(one_gpu) != (9, 0):
        pytest.skip("needs an sm_90 GPU")
    if sm90.library() is None:
        pytest.fail(f"the sm_90a kernel did not build: {sm90.why_not()}")
    return sm90


def _gathered(st, world, m_loc, k):
    rank, lin = st.arrivals.rank, st.arrivals.lin
    shards = [st.a2 if s == rank else st.slots2[s * m_loc:(s + 1) * m_loc] for s in range(world)]
    return torch.stack([sh.view(m_loc // lin, lin, k) for sh in shards], dim=1).reshape(-1, k)


def _check(st, world, m_loc, k):
    gathered = _gathered(st, world, m_loc, k)
    for out, w, b in zip(st.products.outs, st.weights, st.biases):
        truth = gathered.float() @ w.float() + (b.float() if b is not None else 0)
        cublas = torch.mm(gathered, w) + (b if b is not None else 0)
        assert within_tolerance(rel_err(out, truth), rel_err(cublas, truth)), (rel_err(out, truth), rel_err(cublas, truth))


@pytest.mark.parametrize("world, m_loc, k, ns, lin, bias", [
    (2, 1024, 512, [768], None, False),          # TMA store, one B
    (2, 2048, 4096, [2048, 512, 512], 512, True),  # q/k/v with biases, 3-D rows (runs of 512)
    (4, 333, 520, [1000, 264, 512], 111, True),  # ragged tiles and K, runs of 111: pointer stores
    (3, 640, 256, [256, 256, 256, 384], 320, False),  # four B's: two launches
])
def test_sm90_consumer_matches_cublas(one_gpu, world, m_loc, k, ns, lin, bias):
    from torch_commopt.kernels.matmul.gpu.ag_matmul import launch_fused

    sm90 = _sm90(one_gpu)
    gen = torch.Generator(device="cuda").manual_seed(world * 7 + k)
    st = ag_standins(m_loc, k, ns, Standin(world, lin, True, torch.bfloat16, gen), bias=bias)
    for out in st.products.outs:
        out.fill_(float("nan"))
    ran = []
    real = sm90.ag_gemm

    def spy(*args, **kw):
        ran.append(real(*args, **kw))
        return ran[-1]

    sm90.ag_gemm = spy
    try:
        launch_fused(st.a2, st.slots2, st.products, st.arrivals, {"impl": "sm90"})
    finally:
        sm90.ag_gemm = real
    assert ran == [True]
    _check(st, world, m_loc, k)
    assert int(st.arrivals.status[0]) == 0


def test_sm90_refusal_runs_triton_and_says_why(one_gpu, caplog):
    """fp16 and row-major weights are not the kernel's: the Triton consumer runs, logged once."""
    from torch_commopt.kernels.matmul.gpu.ag_matmul import launch_fused

    sm90 = _sm90(one_gpu)
    gen = torch.Generator(device="cuda").manual_seed(5)
    st = ag_standins(512, 256, [512], Standin(2, None, False, torch.bfloat16, gen))
    assert sm90.ag_refusal(st.a2, st.slots2, st.weights, st.products.outs, st.biases) == \
        "a weight is not K-major (nn.Linear's layout)"
    with caplog.at_level("INFO", logger=sm90.__name__):
        launch_fused(st.a2, st.slots2, st.products, st.arrivals, {"impl": "sm90", "tma": 1})
    _check(st, 2, 512, 256)
    assert any("not K-major" in r.getMessage() for r in caplog.records)


def test_sm90_waits_for_a_piece_that_lands_after_it_started(one_gpu):
    """The peer's rows and then their flag written on another stream after a sleep, while the
    kernel (on fewer blocks than SMs, leaving room for the writer's kernels) already runs: its
    tiles of that slot wait, and the product is the landed rows'."""
    sm90 = _sm90(one_gpu)
    world, m_loc, k, ns = 2, 1024, 1024, [512]
    gen = torch.Generator(device="cuda").manual_seed(11)
    st = ag_standins(m_loc, k, ns, Standin(world, None, True, torch.bfloat16, gen))
    at = st.arrivals
    landed = st.slots2[:m_loc].clone()
    st.slots2[:m_loc].normal_()  # stale rows until the piece lands
    at.flags[at.flag_base: at.flag_base + 256] = 0  # slot 0 (the peer's): nothing landed yet
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms: the kernel is spinning by then
        st.slots2[:m_loc].copy_(landed)
        at.flags[at.flag_base: at.flag_base + 256].fill_(1)
    assert sm90.ag_gemm(st.a2, st.slots2, st.products, at, sm90.Launch(8, 64))
    torch.cuda.synchronize()
    _check(st, world, m_loc, k)


def test_sm90_debug_wait_gives_up_and_reports_the_piece(one_gpu):
    """A piece that never lands: with a bound the kernel stops spinning, ends, and records (code 2,
    slot, chunk, seen, expected) in the status words, as the Triton kernels' debug waits do."""
    sm90 = _sm90(one_gpu)
    gen = torch.Generator(device="cuda").manual_seed(13)
    st = ag_standins(512, 256, [256], Standin(2, None, True, torch.bfloat16, gen))
    at = st.arrivals
    at.flags[at.flag_base: at.flag_base + 256] = 0
    assert sm90.ag_gemm(st.a2, st.slots2, st.products, at, sm90.Launch(8, 8, 20_000_000))
    torch.cuda.synchronize()
    status = at.status.tolist()
    assert status[0] == 1 and status[1] == 2 and status[2] == 0 and status[4] == 0 and status[5] == at.epoch


@pytest.mark.parametrize("grid", [7, 24, 33, 60, 132])
def test_sm90_stream_k_tail_matches_cublas(one_gpu, grid):
    """Tile counts that leave a partial last round on `grid` blocks.  Where at most half the
    blocks would have a tile in it, its k steps are dealt over every block, partials left in the
    workspace and added by each tile's owner; else the round runs whole tiles.  The workspace is
    poisoned beforehand: finite values in it afterwards show the tail ran split (and only then),
    and the counters are back at zero for the next launch."""
    sm90 = _sm90(one_gpu)
    world, m_loc, k, ns = 2, 1024, 1024, [768, 512]
    gen = torch.Generator(device="cuda").manual_seed(grid)
    st = ag_standins(m_loc, k, ns, Standin(world, 256, True, torch.bfloat16, gen), bias=True)
    tiles = world * (m_loc // sm90.BM) * sum(-(-n // sm90.BN) for n in ns)
    tail = tiles % grid
    assert tail, "the case must leave a partial round"
    stream = torch.cuda.current_stream().cuda_stream
    work, counters = sm90._workspace(one_gpu, stream, grid)
    work.fill_(float("nan"))
    assert sm90.ag_gemm(st.a2, st.slots2, st.products, st.arrivals, sm90.Launch(8, grid))
    torch.cuda.synchronize()
    _check(st, world, m_loc, k)
    assert int(counters.abs().sum()) == 0
    assert bool(work[: grid * sm90.BM * sm90.BN].isfinite().any()) == (2 * tail <= grid)


def _run_rs(one_gpu, *, world, m_seg, k, n, lin=None, direct=True, alpha=1.0, seed=0):
    """The sm_90a reduce-scatter producer through launch_rs_fused(impl=sm90), with local stand-ins
    for the peers' receive slots and flags: this rank's reduced segment, every peer's partial where
    it was sent, and every chunk's tile count."""
    from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS
    from torch_commopt.kernels.matmul.gpu.layout import cdiv
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import launch_rs_fused
    from torch_commopt.testing.fused_standins import rs_standins

    sm90 = _sm90(one_gpu)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    st = rs_standins(m_seg, k, n, Standin(world, lin, True, torch.bfloat16, gen), direct=direct, bm=sm90.BM)
    a2, w, recv, rank, lin = st.a2, st.weight, st.recv, st.segments.rank, st.segments.lin
    outer, chunk_mt, tiles_m, tiles_n = m_seg // lin, st.segments.chunk_mt, cdiv(m_seg, sm90.BM), cdiv(n, sm90.RS_BN)
    ran, real = [], sm90.rs_gemm
    sm90.rs_gemm = lambda *a, **kw: ran.append(real(*a, **kw)) or ran[-1]
    try:
        launch_rs_fused(a2, w, st.targets, st.signals, st.segments, alpha, {"impl": "sm90"})
    finally:
        sm90.rs_gemm = real
    assert ran == [True]
    torch.cuda.synchronize()
    assert int(st.signals.status[0]) == 0
    seg_rows = [a2.view(outer, world, lin, k)[:, s].reshape(m_seg, k) for s in range(world)]
    partials = sum(recv[s].float() for s in range(world) if s != rank)
    truth = alpha * (seg_rows[rank].float() @ w.float() + partials)
    cublas = (alpha * (torch.mm(seg_rows[rank], w).float() + partials)).to(torch.bfloat16)
    out = st.targets.out
    assert within_tolerance(rel_err(out, truth), rel_err(cublas, truth)), (rel_err(out, truth), rel_err(cublas, truth))
    tiles = [min(chunk_mt, tiles_m - c * chunk_mt) * tiles_n for c in range(cdiv(tiles_m, chunk_mt))]
    for s in range(world):
        if s == rank:
            continue
        got = st.peer_bufs[s][rank] if direct else st.send[s]
        truth_s = seg_rows[s].float() @ w.float()
        assert within_tolerance(rel_err(got, truth_s), rel_err(torch.mm(seg_rows[s], w), truth_s))
        counters = (st.peer_flags[s][COUNTERS + rank * MAX_CHUNKS:] if direct
                    else st.flags[COUNTERS + s * MAX_CHUNKS:])[:len(tiles)]
        assert counters.tolist() == tiles
        # The TMA stores stay inside the segment's slot: the peer's other slots are untouched.
        others = [q for q in range(world) if q != rank]
        assert not direct or int(st.peer_bufs[s][others].count_nonzero()) == 0, s
    assert direct or int(st.send[rank].count_nonzero()) == 0


@pytest.mark.parametrize("direct", [True, False])
def test_sm90_rs_matches_cublas(one_gpu, direct):
    _run_rs(one_gpu, world=2, m_seg=1024, k=512, n=768, direct=direct)


def test_sm90_rs_ragged_avg_world4(one_gpu):
    """Rows and K that are not tile multiples (a last tile reads the next segment's rows and masks
    them), N not a multiple of the tile, avg scaling, world 4."""
    _run_rs(one_gpu, world=4, m_seg=333, k=520, n=1000, alpha=0.25, seed=3)


@pytest.mark.parametrize("direct", [True, False])
def test_sm90_rs_eight_ranks_ragged(one_gpu, direct):
    """The most ranks a launch takes (a destination tensor map each), segments of ragged rows
    whose last tile's stores the maps clip at the slot's end."""
    _run_rs(one_gpu, world=8, m_seg=200, k=320, n=520, direct=direct, seed=5)


def test_sm90_rs_refuses_nine_ranks_and_unknown_peers(one_gpu):
    """Nine ranks would need a ninth destination map; direct stores without the peers' host
    addresses cannot encode theirs: both refused (the Triton kernel runs)."""
    from torch_commopt.testing.fused_standins import rs_standins

    sm90 = _sm90(one_gpu)
    gen = torch.Generator(device="cuda").manual_seed(6)
    st = rs_standins(128, 128, 256, Standin(9, None, True, torch.bfloat16, gen), bm=sm90.BM)
    assert "more than 8 ranks" in sm90.rs_refusal(st.a2, st.weight, st.targets, st.segments)
    st = rs_standins(128, 128, 256, Standin(2, None, True, torch.bfloat16, gen), bm=sm90.BM)
    unknown = st.targets._replace(host_bases=())
    assert "not known on the host" in sm90.rs_refusal(st.a2, st.weight, unknown, st.segments)
    ce = rs_standins(128, 128, 256, Standin(2, None, True, torch.bfloat16, gen), direct=False, bm=sm90.BM)
    assert sm90.rs_refusal(ce.a2, ce.weight, ce.targets._replace(host_bases=()), ce.segments) is None


def test_sm90_rs_3d_rows_and_the_refusal(one_gpu, caplog):
    """Rows of a 3-D scatter in runs that are a multiple of the tile; a run of 111 rows would
    split a tile: refused, logged, and the Triton kernel runs."""
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import launch_rs_fused
    from torch_commopt.testing.fused_standins import rs_standins

    _run_rs(one_gpu, world=2, m_seg=512, k=256, n=384, lin=128, seed=4)
    sm90 = _sm90(one_gpu)
    st = rs_standins(333, 256, 384, Standin(2, 111, True, torch.bfloat16, torch.Generator(device="cuda")))
    assert "span two runs" in sm90.rs_refusal(st.a2, st.weight, st.targets, st.segments)
    with caplog.at_level("INFO", logger=sm90.__name__):
        launch_rs_fused(st.a2, st.weight, st.targets, st.signals, st.segments, 1.0, {"impl": "sm90", "bn": 256})
    torch.cuda.synchronize()
    assert any("span two runs" in r.getMessage() for r in caplog.records)
