"""Low-latency collectives for decode-sized messages: the one-shot and two-shot all-reduces.

A decode step's all-reduces move a few KB.  NCCL takes tens of microseconds for that; the time
is latency, not bandwidth.  The one-shot all-reduce is one kernel launch: every rank has written
its partial into its slot of a symmetric buffer, then each block of the kernel

    barrier 0    tells every peer it has arrived, and waits until every peer has: every
                 partial is in place (each was written before its rank's kernel started)
    sum          loads its range of every rank's slot and sums in fp32 in rank order 0..W-1,
                 cast once: every rank gets the same bits (the reference, Schedule gather_sum,
                 sums the same way)
    barrier 1    tells every peer it has read, and waits until every peer has: no rank
                 writes its slot again (its next call's partial) while a peer still reads it

The two-shot all-reduce (ll_twoshot_kernel) reads less at more ranks: each rank sums one segment
of every rank's slot into its reduced region, then copies every rank's reduced segment out, with
the same two barriers around the first step (the same bits: Schedule scatter_gather).

Each barrier is per block: block b of a rank waits only for block b of its peers, which read
the same range.  Its flags (symm.LL_BAR, per phase, block and peer) take the values 0 and 1
only and are back at 0 when the kernel ends -- no epoch, no token, no host step -- so eager
calls and any number of CUDA graphs holding such calls may be replayed in any order, as long
as the calls of a group stay in one stream order (every rank issues them in the same order).
A peer's signal for phase p of call n + 1 cannot land before this rank cleared it in call n:
the peer passes phase 1 - p of call n only after this rank signalled it, which it does after
clearing.

The buffer (a slot and a reduced region, LL_CAP_BYTES each) is allocated once per group, at the first call, and never regrown:
a larger message runs another schedule.  Waits are spins on the flags, acquire at system
scope (waits.spin_geq); in debug mode each is bounded in wall time and a timeout is recorded
in the runtime's status; otherwise, with the watchdog on, the spins are bounded the same way and the
watchdog reads the status (no per-call marks: LowLatency._run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from torch_commopt.core import env
from torch_commopt.kernels.gpu import symm, watchdog
from torch_commopt.kernels.gpu.waits import spin_geq

PURPOSE = "low-latency"  # the runtime's own_buffer key
LL_CAP_BYTES = 16 << 20  # the buffer: the largest message the low-latency collectives take


@triton.jit
def _ll_barrier(flag_bases, me, block, status, bound, BAR: tl.constexpr, W: tl.constexpr, CODE: tl.constexpr,
                MAX_WORLD: tl.constexpr, DEBUG: tl.constexpr, RELEASE: tl.constexpr = True):
    """Block `block` of rank `me` at the barrier whose flags start at BAR (see the module
    docstring): its flag set in every peer, then every peer's awaited and cleared.  RELEASE: the
    signal releases this rank's writes (the slot, before barrier 0); else it is relaxed, where it
    only says this block is done reading (its loads have returned: the block's stores of their
    sum come first), which saves a system-scope fence."""
    base = BAR + block * MAX_WORLD
    mine = tl.load(flag_bases + me).to(tl.pointer_type(tl.int32))
    # every warp of the block past its loads and stores before one thread signals for the block
    # (a scalar atomic is one thread's: without this, a peer told "done reading" could rewrite
    # its slot under another warp's loads, and the two-shot's reduced segment could be read
    # before every warp stored its part)
    tl.debug_barrier()
    for p in tl.static_range(W):
        if p != me:
            peer = tl.load(flag_bases + p).to(tl.pointer_type(tl.int32))
            if RELEASE:
                tl.atomic_xchg(peer + base + me, 1, sem="release", scope="sys")
            else:
                tl.atomic_xchg(peer + base + me, 1, sem="relaxed", scope="sys")
    for p in tl.static_range(W):
        if p != me:
            if DEBUG:
                # a wait of this call that gave up already (status[0]): the call is garbage and
                # reported; waiting out another bound would only double the time to the error
                if tl.atomic_add(status, 0, sem="relaxed", scope="gpu") == 0:
                    spin_geq(mine + base + p, 1, status, CODE, p, block, bound, DEBUG)
            else:
                spin_geq(mine + base + p, 1, status, CODE, p, block, bound, DEBUG)
            tl.atomic_xchg(mine + base + p, 0, sem="relaxed", scope="sys")


@triton.jit
def _slot(slot_bases, r, like, ALIGNED: tl.constexpr):
    """Rank r's slot (address in slot_bases[r]) as a pointer of like's element type.  ALIGNED (`like`
    lies on 16 bytes, the launcher checked; every slot does, LowLatency checked at its creation):
    the compiler is told so -- an address loaded from a table has no alignment it can see -- and
    loads 16 bytes a thread at a time instead of one element."""
    addr = tl.load(slot_bases + r)
    if ALIGNED:
        size: tl.constexpr = like.dtype.element_ty.primitive_bitwidth // 8
        delta = (addr - like.to(tl.int64, bitcast=True)) // size
        return like + tl.multiple_of(delta, 16 // size)
    return addr.to(tl.pointer_type(like.dtype.element_ty))


@triton.jit
def _sum_into(dst, slot_bases, like, at, start, lim, W: tl.constexpr, BLOCK: tl.constexpr, AVG: tl.constexpr,
              ALIGNED: tl.constexpr):
    """dst[start + i] = the sum over ranks 0..W-1 (fp32, in rank order; AVG: divided by W) of every
    rank's slot[at + start + i], as like's dtype, for i < BLOCK below lim; a whole block unmasked
    (vector loads and stores where the addresses allow)."""
    offs = start + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if start + BLOCK <= lim:
        for r in tl.static_range(W):
            acc += tl.load(_slot(slot_bases, r, like, ALIGNED) + at + offs, volatile=True).to(tl.float32)
        if AVG:
            acc = acc / W
        tl.store(dst + offs, acc.to(like.dtype.element_ty))
    else:
        mask = offs < lim
        for r in tl.static_range(W):
            acc += tl.load(_slot(slot_bases, r, like, ALIGNED) + at + offs, mask=mask, other=0.0,
                           volatile=True).to(tl.float32)
        if AVG:
            acc = acc / W
        tl.store(dst + offs, acc.to(like.dtype.element_ty), mask=mask)


@triton.jit
def _copy(dst, src, start, lim, BLOCK: tl.constexpr):
    """dst[start + i] = src[start + i] for i < BLOCK below lim; a whole block unmasked."""
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= lim:
        tl.store(dst + offs, tl.load(src + offs, volatile=True))
    else:
        mask = offs < lim
        tl.store(dst + offs, tl.load(src + offs, mask=mask, other=0.0, volatile=True), mask=mask)


@triton.jit(do_not_specialize=["me", "n", "bound"])
def ll_oneshot_kernel(slot_bases, out, n, flag_bases, me, status, bound, W: tl.constexpr, BAR0: tl.constexpr,
                      BAR1: tl.constexpr, CODE: tl.constexpr, MAX_WORLD: tl.constexpr, BLOCK: tl.constexpr,
                      AVG: tl.constexpr, ALIGNED: tl.constexpr, DEBUG: tl.constexpr):
    """out[:n] = the sum over ranks r = 0..W-1 of rank r's slot[:n] (fp32, in rank order; AVG:
    divided by W), every rank's slot address in slot_bases (int64 [W])."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _ll_barrier(flag_bases, me, pid, status, bound, BAR0, W, CODE, MAX_WORLD, DEBUG)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        _sum_into(out, slot_bases, out, 0, start, n, W, BLOCK, AVG, ALIGNED)
    _ll_barrier(flag_bases, me, pid, status, bound, BAR1, W, CODE, MAX_WORLD, DEBUG, False)


@triton.jit(do_not_specialize=["me", "n", "seg", "bound"])
def ll_twoshot_kernel(slot_bases, red_bases, out, n, seg, flag_bases, me, status, bound, W: tl.constexpr,
                      BAR0: tl.constexpr, BAR1: tl.constexpr, CODE: tl.constexpr, MAX_WORLD: tl.constexpr,
                      BLOCK: tl.constexpr, AVG: tl.constexpr, ALIGNED: tl.constexpr, DEBUG: tl.constexpr):
    """The two-shot all-reduce: after barrier 0, rank `me` sums its segment [me * seg, (me + 1) *
    seg) of every rank's slot (fp32, rank order, cast once) into its reduced region (red_bases);
    after barrier 1, it copies every rank's reduced segment into out.  No third barrier: a rank
    rewrites its slot (its next partial) only once its kernel passed barrier 1, when every peer has
    read its segment of it, and its reduced region only after barrier 0 of its next call, which no
    peer reaches before it has copied this call's segments out.  seg is a multiple of 16 bytes
    (segment()), which the compiler is told where ALIGNED."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if ALIGNED:
        vec: tl.constexpr = 16 // (out.dtype.element_ty.primitive_bitwidth // 8)
        seg = seg // vec * vec
    _ll_barrier(flag_bases, me, pid, status, bound, BAR0, W, CODE, MAX_WORLD, DEBUG)
    mine = _slot(red_bases, me, out, ALIGNED)
    lim = tl.minimum(seg, n - me * seg)  # this rank's segment's length (the last may be short or empty)
    for start in range(pid * BLOCK, seg, nprog * BLOCK):
        _sum_into(mine, slot_bases, out, me * seg, start, lim, W, BLOCK, AVG, ALIGNED)
    _ll_barrier(flag_bases, me, pid, status, bound, BAR1, W, CODE, MAX_WORLD, DEBUG)
    for start in range(pid * BLOCK, seg, nprog * BLOCK):
        for q in tl.static_range(W):
            _copy(out + q * seg, _slot(red_bases, q, out, ALIGNED), start, tl.minimum(seg, n - q * seg), BLOCK)


@triton.jit(do_not_specialize=["me", "n", "bound"])
def ll_gather_kernel(slot_bases, out, n, flag_bases, me, status, bound, W: tl.constexpr, BAR0: tl.constexpr,
                     BAR1: tl.constexpr, CODE: tl.constexpr, MAX_WORLD: tl.constexpr, BLOCK: tl.constexpr,
                     ALIGNED: tl.constexpr, N_ALIGNED: tl.constexpr, DEBUG: tl.constexpr):
    """The one-shot all-gather: out[r * n:(r + 1) * n] = rank r's slot[:n] for every r, between the
    same two barriers as the one-shot all-reduce (every slot written before, none rewritten while
    read).  N_ALIGNED: n is a multiple of 16 bytes (rank r's part of out lies on 16 bytes)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if N_ALIGNED:
        vec: tl.constexpr = 16 // (out.dtype.element_ty.primitive_bitwidth // 8)
        n = n // vec * vec
    _ll_barrier(flag_bases, me, pid, status, bound, BAR0, W, CODE, MAX_WORLD, DEBUG)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        for r in tl.static_range(W):
            _copy(out + r * n, _slot(slot_bases, r, out, ALIGNED), start, n, BLOCK)
    _ll_barrier(flag_bases, me, pid, status, bound, BAR1, W, CODE, MAX_WORLD, DEBUG, False)


MIN_BLOCK, MAX_BLOCK = 1024, 8192


def block_for(n: int) -> int:
    """Elements a block sums per step for a message of n: at least MIN_BLOCK (16 bytes a thread of
    four warps at bf16), and so that the grid's LL_BLOCKS blocks cover n in one step, up to
    MAX_BLOCK (each step waits out a round trip over the link: more steps, more round trips)."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(triton.cdiv(n, symm.LL_BLOCKS))))


def blocks_for(n: int) -> int:
    """The grid of a one-shot call over n elements (the same on every rank: n is)."""
    return max(1, min(symm.LL_BLOCKS, triton.cdiv(n, block_for(n))))


@dataclass(frozen=True)
class Ranks:
    """Where a low-latency kernel finds every rank of its group: the slots' addresses, the reduced
    regions' (two-shot), the flag arrays' (int64 [W] device tables each); this rank, the group's
    size, and the status words a debug-mode timeout is recorded in."""

    slot_bases: torch.Tensor
    red_bases: torch.Tensor | None
    flag_bases: torch.Tensor
    me: int
    world: int
    status: torch.Tensor


def _constants(n: int, out: torch.Tensor) -> dict:
    """The kernels' constants for a message of n elements into `out`: the barriers' flags, the
    block and its warps, and whether `out` lies on 16 bytes as the slots do (the vector loads)."""
    block = block_for(n)
    return dict(BAR0=symm.LL_BAR, BAR1=symm.LL_BAR + symm.LL_BLOCKS * symm.MAX_WORLD,
                CODE=symm.WAIT_CODES["ll barrier"], MAX_WORLD=symm.MAX_WORLD, BLOCK=block,
                num_warps=4 if block <= 1024 else 8, ALIGNED=out.data_ptr() % 16 == 0)


def launch_oneshot(ranks: Ranks, out: torch.Tensor, *, avg: bool, debug: bool, bound: int) -> None:
    """The one-shot all-reduce of every rank's slot into `out` (contiguous, its numel elements),
    on the current stream."""
    n = out.numel()
    ll_oneshot_kernel[(blocks_for(n),)](
        ranks.slot_bases, out, n, ranks.flag_bases, ranks.me, ranks.status, bound, W=ranks.world, AVG=avg,
        DEBUG=debug, **_constants(n, out))


def segment(n: int, world: int, element_size: int) -> int:
    """Elements of a rank's segment in the two-shot all-reduce, a multiple of 16 bytes (the last
    one shorter, or empty)."""
    vec = 16 // element_size
    return triton.cdiv(triton.cdiv(n, world), vec) * vec


def launch_twoshot(ranks: Ranks, out: torch.Tensor, *, avg: bool, debug: bool, bound: int) -> None:
    """The two-shot all-reduce of every rank's slot into `out`, through every rank's reduced
    region, on the current stream."""
    n = out.numel()
    seg = segment(n, ranks.world, out.element_size())
    ll_twoshot_kernel[(blocks_for(seg),)](
        ranks.slot_bases, ranks.red_bases, out, n, seg, ranks.flag_bases, ranks.me, ranks.status, bound,
        W=ranks.world, AVG=avg, DEBUG=debug, **_constants(seg, out))


def launch_gather(ranks: Ranks, out: torch.Tensor, n: int, *, debug: bool, bound: int) -> None:
    """The one-shot all-gather of every rank's slot[:n] into `out` (W * n elements), on the current stream."""
    ll_gather_kernel[(blocks_for(n),)](
        ranks.slot_bases, out, n, ranks.flag_bases, ranks.me, ranks.status, bound, W=ranks.world, DEBUG=debug,
        N_ALIGNED=n * out.element_size() % 16 == 0, **_constants(n, out))


class LowLatency:
    """A group's low-latency buffer: this rank's slot (a view to compute a partial into) and the
    one-shot all-reduce over every rank's slot."""

    def __init__(self, rt) -> None:
        self.rt = rt
        # the slot, then the two-shot's reduced region: LL_CAP_BYTES each; collective, once per group
        self.buf = rt.own_buffer(PURPOSE, 2 * LL_CAP_BYTES)
        addresses = [self.buf.address(r, 0) for r in range(rt.world)]
        if any(a % 16 for a in addresses):  # what the kernels' 16-byte loads assume (_slot)
            raise RuntimeError(f"commopt: low-latency slots off 16 bytes: {[hex(a) for a in addresses]}")
        self.slot_bases = rt._int64_table(symm.LL_PTRS, addresses)  # noqa: SLF001
        self.red_bases = rt._int64_table(symm.LL_PTRS + 2 * symm.MAX_WORLD,  # noqa: SLF001
                                         [x + LL_CAP_BYTES for x in addresses])
        self.ranks = Ranks(self.slot_bases, self.red_bases, rt.flag_bases_dev, rt.rank, rt.world, rt.status)

    @staticmethod
    def fits(numel: int, dtype: torch.dtype) -> bool:
        return numel * torch.empty((), dtype=dtype).element_size() <= LL_CAP_BYTES

    def slot(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """This rank's slot as a (shape, dtype) tensor: what the peers read."""
        return self.buf.view(self.rt.rank, 0, tuple(shape), dtype)

    def all_gather(self, out: torch.Tensor, debug: bool) -> torch.Tensor:
        """out (W * n elements, contiguous) = every rank's slot[:n] (as out's dtype) in rank order,
        on the current stream; the slots were written before, on this stream.  Watched as
        all_reduce is."""
        n = out.numel() // self.rt.world
        self._run(lambda bounded, bound: launch_gather(self.ranks, out, n, debug=bounded, bound=bound),
                  "one-shot all-gather", debug)
        return out

    def _run(self, launch, label: str, debug: bool) -> None:
        """launch(bounded, bound): debug mode bounds the spins and checks the status after the
        call (a sync); otherwise, with the watchdog on, the spins bound themselves and the watchdog
        reads the status (watchdog.Watchdog.watch_status: no per-call marks, which would cost a
        replayed decode all-reduce more than the all-reduce itself); with it off, they are unbounded."""
        rt = self.rt
        if debug:
            launch(True, symm.wait_bound())
            if not torch.cuda.is_current_stream_capturing():  # the check synchronizes: not in a capture
                rt.check_status(label)  # (a replay's timeout stays in the status: the next eager check reports it)
            return
        rt.check_open()  # a closed group raises at once
        dog = watchdog.get() if env.watchdog() else None
        if dog is not None:
            dog.watch_status(rt, label)
        launch(dog is not None, symm.wait_bound())

    def all_reduce(self, out: torch.Tensor, reduce_op: str, debug: bool, two_shot: bool = False) -> torch.Tensor:
        """out = every rank's slot (as out's shape and dtype) summed (avg: / W), on the current
        stream; the slots were written before, on this stream.  two_shot: the two-shot kernel.
        Outside debug mode, with the GPU-wait watchdog on (kernels/gpu/watchdog.py), its barrier
        spins give up after the bound and the watchdog names the call and the peer from the
        status words (_run)."""
        label = "two-shot all-reduce" if two_shot else "one-shot all-reduce"
        launch = launch_twoshot if two_shot else launch_oneshot
        self._run(lambda bounded, bound: launch(self.ranks, out, avg=reduce_op == "avg", debug=bounded, bound=bound),
                  label, debug)
        return out


_BY_RUNTIME: dict[int, LowLatency] = {}


def for_runtime(rt) -> LowLatency:
    """The group's LowLatency, made at its first call (collective: every rank of the group)."""
    ll = _BY_RUNTIME.get(id(rt))
    if ll is None or ll.rt is not rt:
        ll = _BY_RUNTIME[id(rt)] = LowLatency(rt)
    return ll
