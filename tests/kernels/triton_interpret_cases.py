"""The GPU schedules' Triton kernels on the CPU, in Triton's interpreter (TRITON_INTERPRET=1):
run as a script by test_triton_interpreter.py, in a process of its own (the variable must be
set before any kernel is decorated).  `python triton_interpret_cases.py GROUP...` runs the
cases of each GROUP in turn and prints "ok GROUP <cases>" when every one passed.

What the interpreter runs here, with the peers stood in for as in
tests/gpu/test_fused_gemm_one_gpu.py (their slots filled and their flags set beforehand, so
no wait spins for long: the interpreter runs a grid's programs one after another, and a
program waiting for a later one would wait forever):
- ag:    the all-gather GEMM's consumer (ag_matmul.launch_fused: ag_gemm_kernel, and
         ag_gemm_tma_kernel with tensor descriptors): tile order, row mapping of 3-D rows,
         several B's, bias, K not a multiple of BK, K-major and row-major B, fp32 and fp16;
- rs:    the reduce-scatter GEMM (matmul_reduce.launch_rs_fused: rs_gemm_kernel), pointer
         loads and TMA, direct stores into a peer's slot through an address read from
         recv_bases and copy-engine staging, the tile counters it bumps, avg scaling;
- ll:    the one-shot all-reduce and all-gather (kernels/gpu/lowlat.py): the fp32 rank-order sum
         bit for bit as its reference, avg, a tail, a grid smaller than the blocks of work; each
         barrier's flags told to every peer and cleared at home; a peer that never arrives
         reported in debug mode; the two-shot one (ll_twoshot_kernel), the peers' reduced
         segments stood in for: its own segment's sum and the whole result, bit for bit;
- waits: spin_geq's debug bound (waits.bounded_wait): a flag that is set passes, one that
         never is gives up after the bound and records (code, src, chunk, seen, expected);
         the consumers above with debug=True, where a wrong flag index is reported in
         `status` instead of hanging; the SM-split producer's copy (copy_rows).
Each kernel's flags hold exactly the entries it must wait on, so a kernel reading another
index waits on a zero.

What the interpreter cannot run (and the stand-ins used instead):
- inline PTX (`tl.inline_asm_elementwise`: "inline_asm not supported in interpreter mode"):
  `%globaltimer` (cuda_extra.globaltimer, the debug bound's clock) is replaced by a clock that
  advances a microsecond per read, and `fence.proxy.async` (ag_gemm_tma_kernel's fence after
  a peer's flag) by a no-op: the interpreter's one thread has no asynchronous proxy to order;
- bfloat16 tl.dot: the interpreter multiplies bfloat16 operands as their raw bit patterns
  (numpy has no bfloat16), so the GEMMs run here in fp32 and fp16 (bf16: tests/gpu);
- anything concurrent: memory ordering (acquire/release at system scope, bar.sync), a peer
  kernel or copy engine racing the consumer, the persistent grid's co-residency; and speed.
"""

from __future__ import annotations

import itertools
import os
import sys
from types import SimpleNamespace

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (test_triton_interpreter.py does)"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402, F401  (the interpreter requires it among a jit function's globals)

from torch_commopt.core import env  # noqa: E402
from torch_commopt.kernels.gpu import waits  # noqa: E402
from torch_commopt.kernels.matmul.gpu import tma as tma_mod  # noqa: E402
from torch_commopt.kernels.matmul.gpu import triton_kernels  # noqa: E402
from torch_commopt.testing.validate import rel_err, within_tolerance  # noqa: E402

_clock = itertools.count(0, 1000)


def _fake_globaltimer():
    """%globaltimer (ns) for the interpreter: a microsecond later at every read."""
    return next(_clock)


@triton.jit
def _no_fence():
    pass


waits.cuda_extra = SimpleNamespace(globaltimer=_fake_globaltimer)
triton_kernels._fence_proxy_async = _no_fence

TILES = {"bm": 16, "bn": 16, "bk": 16, "gm": 2, "warps": 4, "stages": 2, "sms": 3}  # a grid of 3: a strided tail
FLAG_BASE = 1024
BOUND_NS = 10**6  # the debug bound: a thousand reads of the fake clock
os.environ[env.WAIT_TIMEOUT_S] = str(BOUND_NS / 1e9)  # the consumers' debug bound (symm.wait_bound) too


def _descriptors_taken():
    """Wrap tma.descriptors: the list it returns records whether each call took TMA."""
    took, descriptors = [], tma_mod.descriptors

    def wrapped(*a, **kw):
        took.append(descriptors(*a, **kw))
        return took[-1]

    tma_mod.descriptors = wrapped
    return took


def _close(got, truth, ref, what):
    assert within_tolerance(rel_err(got, truth), rel_err(ref, truth)), (what, rel_err(got, truth), rel_err(ref, truth))


def _ag(name, *, world, m_loc, k, ns, lin=None, bias=False, kmajor=True, dtype=torch.float32, tma=0, debug=False,
        seed=0):
    from torch_commopt.kernels.matmul.gpu.ag_matmul import Arrivals, Products, launch_fused

    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    rank, lin = 1 % world, lin or m_loc
    chunk_rows = max(1, m_loc // 3)
    a2, slots2 = mk(m_loc, k), mk(world * m_loc, k)
    ws = [mk(n, k).t() / k ** 0.5 if kmajor else mk(k, n) / k ** 0.5 for n in ns]
    bs = [mk(n) if bias else None for n in ns]
    flags = torch.zeros(FLAG_BASE + (world + 1) * 256, dtype=torch.int32)
    for s in range(world):  # exactly the pieces the peers' tiles wait on, at epoch 1
        if s != rank:
            flags[FLAG_BASE + s * 256: FLAG_BASE + s * 256 + (m_loc - 1) // chunk_rows + 1] = 1
    status = torch.zeros(8, dtype=torch.int32)
    outs = [torch.full((world * m_loc, n), float("nan"), dtype=dtype) for n in ns]
    took = _descriptors_taken() if tma else []
    launch_fused(a2, slots2, Products(ws, bs, outs), Arrivals(flags, status, FLAG_BASE, rank, world, lin, chunk_rows),
                 {**TILES, "tma": tma}, debug=debug)
    assert status.tolist() == [0] * 8, (name, status.tolist())
    if tma:
        assert took and took[-1] is not None, f"{name}: TMA refused"
    outer = m_loc // lin
    shards = [a2 if s == rank else slots2[s * m_loc:(s + 1) * m_loc] for s in range(world)]
    gathered = torch.stack([sh.view(outer, lin, k) for sh in shards], dim=1).reshape(-1, k)
    for out, w, b in zip(outs, ws, bs):
        truth = gathered.double() @ w.double() + (b.double() if b is not None else 0)
        _close(out, truth, torch.mm(gathered, w) + (b if b is not None else 0), name)


def group_ag():
    _ag("2 ranks", world=2, m_loc=40, k=32, ns=[24])
    _ag("row-major B", world=2, m_loc=40, k=32, ns=[24], kmajor=False)
    _ag("3-D rows, 3 B's, bias, ragged K, fp16, 4 ranks", world=4, m_loc=33, k=40, ns=[40, 8, 24], lin=11, bias=True,
        dtype=torch.float16, seed=3)
    _ag("TMA", world=2, m_loc=48, k=32, ns=[32], tma=1, seed=4)
    _ag("TMA, row-major B, 3-D rows, 2 B's, fp16", world=4, m_loc=48, k=48, ns=[32, 16], lin=16, kmajor=False,
        dtype=torch.float16, tma=1, seed=5)
    return 5


def _rs(name, *, world, m_seg, k, n, lin=None, kmajor=True, direct=True, tma=0, alpha=1.0, dtype=torch.float32,
        debug=False, seed=0):
    from torch_commopt.kernels.gpu.symm import COUNTERS, MAX_CHUNKS
    from torch_commopt.kernels.matmul.gpu.layout import cdiv
    from torch_commopt.kernels.matmul.gpu.matmul_reduce import RsSegments, RsSignals, RsTargets, launch_rs_fused

    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    rank, lin = 1 % world, lin or m_seg
    outer = m_seg // lin
    a2 = mk(world * m_seg, k)  # rows (outer, world, lin): segment s is block s of every outer block
    w = mk(n, k).t() / k ** 0.5 if kmajor else mk(k, n) / k ** 0.5
    recv = mk(world, m_seg, n)  # the peers' partials, landed
    peer_bufs = [torch.zeros(world, m_seg, n, dtype=dtype) for _ in range(world)]
    flags = torch.zeros(COUNTERS + world * MAX_CHUNKS, dtype=torch.int32)
    peer_flags = [torch.zeros_like(flags) for _ in range(world)]
    tiles_m, tiles_n = cdiv(m_seg, TILES["bm"]), cdiv(n, TILES["bn"])
    chunk_mt = max(1, cdiv(tiles_m, 3))
    tiles = [min(chunk_mt, tiles_m - c * chunk_mt) * tiles_n for c in range(cdiv(tiles_m, chunk_mt))]
    for src in range(world):  # every partial this rank waits for has arrived (exactly those flags)
        if src != rank and direct:  # the peers' tile counts of this rank's segment, complete
            flags[COUNTERS + src * MAX_CHUNKS: COUNTERS + src * MAX_CHUNKS + len(tiles)] = torch.tensor(tiles)
        elif src != rank:  # the copy engine's DATA flags (data_base 0) at epoch 1
            flags[src * MAX_CHUNKS: src * MAX_CHUNKS + len(tiles)] = 1
    expected_own = flags.clone()
    send = torch.zeros(world, m_seg, n, dtype=dtype)
    out = torch.full((m_seg, n), float("nan"), dtype=dtype)
    recv_bases = torch.tensor([(recv if s == rank else peer_bufs[s]).data_ptr() for s in range(world)], dtype=torch.int64)
    flag_bases = torch.tensor([(flags if s == rank else peer_flags[s]).data_ptr() for s in range(world)],
                              dtype=torch.int64)
    status = torch.zeros(8, dtype=torch.int32)
    took = _descriptors_taken() if tma else []
    launch_rs_fused(a2, w, RsTargets(out, send, recv, recv_bases, 0, direct, True), RsSignals(flags, flag_bases, status, 0),
                    RsSegments(rank, world, lin, m_seg, chunk_mt), alpha, {**TILES, "tma": tma}, debug=debug)
    assert status.tolist() == [0] * 8, (name, status.tolist())
    if tma:
        assert took and took[-1] is not None, f"{name}: TMA refused"
    seg_rows = [a2.view(outer, world, lin, k)[:, s].reshape(m_seg, k) for s in range(world)]
    partials = sum(recv[s].double() for s in range(world) if s != rank)
    truth = alpha * (seg_rows[rank].double() @ w.double() + partials)
    _close(out, truth, (alpha * (torch.mm(seg_rows[rank], w).double() + partials)).to(dtype), f"{name}: own segment")
    for s in range(world):
        if s == rank:
            continue
        got = peer_bufs[s][rank] if direct else send[s]
        truth_s = seg_rows[s].double() @ w.double()
        _close(got, truth_s, torch.mm(seg_rows[s], w), f"{name}: segment {s}")
        counters = (peer_flags[s][COUNTERS + rank * MAX_CHUNKS:] if direct else flags[COUNTERS + s * MAX_CHUNKS:])
        assert counters[:len(tiles)].tolist() == tiles and not counters[len(tiles):MAX_CHUNKS].any(), (name, s)
    if direct:  # nothing but the counters of this rank's own flags' peers' slots changed, and none of ours
        assert torch.equal(flags, expected_own), name
        assert all(not peer_bufs[s][[r for r in range(world) if r != rank]].any() for s in range(world) if s != rank)


def group_rs():
    for direct in (True, False):
        _rs(f"2 ranks, direct={direct}", world=2, m_seg=48, k=32, n=40, direct=direct)
    _rs("row-major B, avg, ragged, fp16, 4 ranks", world=4, m_seg=37, k=40, n=24, kmajor=False, alpha=0.25,
        dtype=torch.float16, seed=3)
    _rs("3-D rows, copy engine", world=2, m_seg=33, k=32, n=32, lin=11, direct=False, seed=4)
    for direct in (True, False):
        _rs(f"TMA, direct={direct}", world=2, m_seg=48, k=32, n=32, tma=1, direct=direct, seed=5)
    _rs("TMA, 3-D rows of whole tiles, avg", world=4, m_seg=32, k=48, n=16, lin=16, tma=1, alpha=0.25, seed=6)
    return 7


def group_waits():
    # a flag that is set: no report; one never set: the debug bound gives up and reports
    flags = torch.zeros(16, dtype=torch.int32)
    flags[3] = 5
    status = torch.zeros(8, dtype=torch.int32)
    waits.bounded_wait(flags, 3, 5, status, code=2, src=1, chunk=3, bound=BOUND_NS)
    assert status.tolist() == [0] * 8, status.tolist()
    waits.bounded_wait(flags, 3, 4, status, code=2, src=1, chunk=3, bound=BOUND_NS)  # >=, not ==
    assert status.tolist() == [0] * 8, status.tolist()
    start = next(_clock)
    waits.bounded_wait(flags, 3, 6, status, code=4, src=1, chunk=3, bound=BOUND_NS)
    assert status.tolist()[:6] == [1, 4, 1, 3, 5, 6], status.tolist()  # stuck: (code, src, chunk, seen, expected)
    assert next(_clock) - start >= BOUND_NS, "gave up before the bound"
    # int32 wrap-around: a flag past 2**31 - 1 counts as ahead of an epoch just below it
    flags[0], status[:] = -(2**31) + 1, 0
    waits.bounded_wait(flags, 0, 2**31 - 2, status, code=2, src=0, chunk=0, bound=BOUND_NS)
    assert status.tolist() == [0] * 8, status.tolist()
    # the consumers with their debug waits on: the exact flags suffice, and nothing is reported
    _ag("debug waits", world=4, m_loc=33, k=32, ns=[16], lin=11, debug=True)
    _rs("debug waits, direct", world=4, m_seg=40, k=32, n=24, debug=True)
    _rs("debug waits, copy engine", world=2, m_seg=40, k=32, n=24, direct=False, debug=True)
    # the SM-split producer: a grid-stride copy
    src, dst = torch.randn(40000), torch.zeros(40000)
    triton_kernels.copy_rows(src, dst, blocks=3)
    assert torch.equal(src, dst)
    return 8


def _peer_flags(world, me, blocks, missing=None):
    """Every rank's flag array, with the peers' arrivals at both low-latency barriers, for every
    block, already set in me's (but `missing`'s, when given)."""
    from torch_commopt.kernels.gpu import symm

    flags = [torch.zeros(symm.FLAG_SLOTS, dtype=torch.int32) for _ in range(world)]
    for bar in (symm.LL_BAR, symm.LL_BAR + symm.LL_BLOCKS * symm.MAX_WORLD):
        for b in range(blocks):
            for p in range(world):
                if p != me and p != missing:
                    flags[me][bar + b * symm.MAX_WORLD + p] = 1
    return flags


def _ll(name, *, world, me, n, dtype, avg=False, debug=False, missing=None, shift=0):
    """The one-shot all-reduce kernel (lowlat.ll_oneshot_kernel) of rank `me`, its peers stood in
    for: every rank's slot filled, the peers' barrier flags (both phases, every block) set in
    me's flag array -- but `missing`'s, when given, whose wait must then be reported.  shift:
    `out` starts that many elements into its storage (off 16 bytes: the kernel's unaligned form)."""
    from torch_commopt.kernels.gpu import lowlat, symm
    from torch_commopt.kernels.matmul.reference.matmul_reduce import _rank_order_sum

    gen = torch.Generator().manual_seed(n + world)
    slots = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
    blocks = lowlat.blocks_for(n)
    flags = _peer_flags(world, me, blocks, missing)
    phase1 = symm.LL_BAR + symm.LL_BLOCKS * symm.MAX_WORLD
    out, status = torch.zeros(n + shift, dtype=dtype)[shift:], torch.zeros(8, dtype=torch.int32)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ranks = lowlat.Ranks(table(slots), None, table(flags), me, world, status)
    start = next(_clock)
    lowlat.launch_oneshot(ranks, out, avg=avg, debug=debug, bound=BOUND_NS)
    if missing is not None:  # reported: (code, src, chunk) of the first wait that gave up
        assert status[0] == 1 and status[1:4].tolist() == [symm.WAIT_CODES["ll barrier"], missing, 0], (name, status)
        # the other blocks' and the second barrier's waits do not spin (a wait of the call gave up): one bound
        assert next(_clock) - start < 2 * BOUND_NS, (name, "waited out more than one bound")
        return
    assert status.tolist() == [0] * 8, (name, status.tolist())
    want = _rank_order_sum(torch.stack(slots), "avg" if avg else "sum")
    assert torch.equal(out, want), (name, (out.float() - want.float()).abs().max())  # the reference's very bits
    mine = flags[me]
    assert not mine[symm.LL_BAR: phase1 + symm.LL_BLOCKS * symm.MAX_WORLD].any(), f"{name}: flags not cleared"
    for p in range(world):  # me's arrival told to every peer, at both barriers, for every block
        if p != me:
            got = [int(flags[p][bar + b * symm.MAX_WORLD + me]) for bar in (symm.LL_BAR, phase1) for b in range(blocks)]
            assert got == [1] * (2 * blocks), (name, p, got)


def _ll2(name, *, world, me, n, dtype, avg=False):
    """The two-shot all-reduce kernel (lowlat.ll_twoshot_kernel) of rank `me`: every slot filled,
    the peers' reduced regions holding their segments' sums (their kernels' first step, which the
    interpreter cannot run beside this one), their barrier flags set."""
    from torch_commopt.kernels.gpu import lowlat, symm
    from torch_commopt.kernels.matmul.reference.matmul_reduce import _rank_order_sum

    gen = torch.Generator().manual_seed(7 * n + world)
    slots = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
    want = _rank_order_sum(torch.stack(slots), "avg" if avg else "sum")
    seg = lowlat.segment(n, world, torch.empty((), dtype=dtype).element_size())
    reds = [torch.zeros(seg, dtype=dtype) for _ in range(world)]
    for q in range(world):
        if q != me:
            piece = want[q * seg: (q + 1) * seg]
            reds[q][: piece.numel()] = piece
    flags = _peer_flags(world, me, lowlat.blocks_for(seg))
    phase1 = symm.LL_BAR + symm.LL_BLOCKS * symm.MAX_WORLD
    out, status = torch.zeros(n, dtype=dtype), torch.zeros(8, dtype=torch.int32)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    ranks = lowlat.Ranks(table(slots), table(reds), table(flags), me, world, status)
    lowlat.launch_twoshot(ranks, out, avg=avg, debug=True, bound=BOUND_NS)
    assert status.tolist() == [0] * 8, (name, status.tolist())
    assert torch.equal(out, want), (name, (out.float() - want.float()).abs().max())
    mine = want[me * seg: (me + 1) * seg]
    assert torch.equal(reds[me][: mine.numel()], mine), f"{name}: its own segment's sum"
    assert not flags[me][symm.LL_BAR: phase1 + symm.LL_BLOCKS * symm.MAX_WORLD].any(), f"{name}: flags not cleared"


def _llg(name, *, world, me, n, dtype):
    """The one-shot all-gather kernel (lowlat.ll_gather_kernel) of rank `me`: every slot filled, the
    peers' barrier flags set; out must hold every slot in rank order, and the flags be at rest."""
    from torch_commopt.kernels.gpu import lowlat, symm

    gen = torch.Generator().manual_seed(3 * n + world)
    slots = [torch.randn(n + 5, generator=gen).to(dtype) for _ in range(world)]  # longer than n: only n travel
    flags = _peer_flags(world, me, lowlat.blocks_for(n))
    phase1 = symm.LL_BAR + symm.LL_BLOCKS * symm.MAX_WORLD
    out, status = torch.full((world * n,), 7.0, dtype=dtype), torch.zeros(8, dtype=torch.int32)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    lowlat.launch_gather(lowlat.Ranks(table(slots), None, table(flags), me, world, status), out, n, debug=True,
                         bound=BOUND_NS)
    assert status.tolist() == [0] * 8, (name, status.tolist())
    assert torch.equal(out, torch.cat([s[:n] for s in slots])), name
    assert not flags[me][symm.LL_BAR: phase1 + symm.LL_BLOCKS * symm.MAX_WORLD].any(), f"{name}: flags not cleared"


def group_ll():
    _llg("all-gather, one element, 2 ranks", world=2, me=1, n=1, dtype=torch.float32)
    _llg("all-gather, more blocks than the grid, 3 ranks", world=3, me=0, n=lowlat_block() * 70 + 3,
         dtype=torch.float32)
    _ll2("two-shot, one element, 2 ranks", world=2, me=1, n=1, dtype=torch.float32)
    _ll2("two-shot, segments with a short last one, 3 ranks", world=3, me=2, n=lowlat_block() * 2 + 5,
         dtype=torch.float16)
    _ll2("two-shot, more blocks than the grid, 4 ranks, avg", world=4, me=0, n=lowlat_block() * 300 + 9,
         dtype=torch.float32, avg=True)
    _ll("one element, 2 ranks", world=2, me=0, n=1, dtype=torch.float32)
    _ll("a block and a tail, 3 ranks", world=3, me=1, n=lowlat_block() + 37, dtype=torch.float16)
    _ll("out off 16 bytes, 2 ranks", world=2, me=1, n=lowlat_block() + 37, dtype=torch.float16, shift=1)
    _ll("more blocks than the grid, 4 ranks, avg", world=4, me=3, n=lowlat_block() * 70 + 5, dtype=torch.float32,
        avg=True)
    _ll("debug waits, all there", world=2, me=1, n=300, dtype=torch.float16, debug=True)
    _ll("a peer that never arrives", world=3, me=0, n=300, dtype=torch.float32, debug=True, missing=2)
    _ll("a peer that never arrives, three blocks", world=3, me=1, n=lowlat_block() * 2 + 7, dtype=torch.float32,
        debug=True, missing=0)
    return 12


def lowlat_block():
    """The largest block: n past LL_BLOCKS of them gives more blocks than the grid."""
    from torch_commopt.kernels.gpu import lowlat

    return lowlat.MAX_BLOCK


if __name__ == "__main__":
    for group in sys.argv[1:]:
        cases = globals()[f"group_{group}"]()
        print(f"ok {group} {cases}", flush=True)
