"""Triton kernels of the GPU schedules: persistent GEMMs that wait on / release flags.

Memory ordering (why each fence is where it is):
- A consumer loads a flag with an acquire atomic at system scope before it loads the data
  the flag guards; the producer (a peer's copy engine) wrote the data, then the flag with
  a fenced stream write, so the acquire makes the data visible.
- A producer tile stores its outputs from all threads, then `debug_barrier` (bar.sync)
  so every thread's stores precede the single release atomic that bumps the counter;
  release at system scope publishes them to a peer GPU or to the copy engine.
- Spinning blocks never wait for a kernel: producers are copy engines, stream memory
  operations, or tiles of the peer's kernel that themselves wait for nothing, so the
  persistent grid (<= one block per SM) cannot starve its own producer.
Debug mode bounds every spin in wall time and records (code, src, chunk, seen, expected) in `status`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch_commopt.kernels.gpu.waits import spin_geq


@triton.jit
def _block_rows(block, i, LIN, WORLD: tl.constexpr):
    """Row of the full (rank-blocked) tensor holding local row i of rank-block `block`.
    The full tensor is (outer, WORLD, LIN) rows; a block's local rows are (outer, LIN)."""
    return (i // LIN) * (WORLD * LIN) + block * LIN + (i % LIN)


@triton.jit
def _tile_coords(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles share their B column tiles in L2."""
    width = GROUP_M * tiles_n
    group = local // width
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % size_m
    pid_n = (local % width) // size_m
    return pid_m, pid_n


@triton.jit
def _mainloop(a_base, rows, row_mask, b_base, sbk, sbn, offs_n, n_mask, K,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """acc[BM, BN] = A[rows, :] @ B[:, offs_n] in fp32; A rows are contiguous with stride K."""
    offs_k = tl.arange(0, BK)
    a_ptrs = a_base + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    b_ptrs = b_base + offs_k[:, None].to(tl.int64) * sbk + offs_n[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        if EVEN_K:
            a_blk = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b_blk = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - kb * BK
            a_blk = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b_blk = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a_blk, b_blk, acc)
        a_ptrs += BK
        b_ptrs += BK * sbk
    return acc


# Per-call values (epoch, bounds, offsets) must not pick specializations: a new variant
# would JIT-compile in the middle of a run (an epoch of 16 is "divisible by 16").
@triton.jit(do_not_specialize=["epoch", "bound", "rank", "chunk_rows", "flag_base", "num_progs"])
def ag_gemm_kernel(
    a_local, a_slots, flags, status, epoch, bound,
    b0, b1, b2, c0, c1, c2, bias0, bias1, bias2,
    sbk0, sbn0, sbk1, sbn1, sbk2, sbn2, N0, N1, N2,
    M_loc, K, LIN, rank, chunk_rows, flag_base, num_progs,
    WORLD: tl.constexpr, NUM_B: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DEBUG: tl.constexpr,
):
    """out_i[full rows] = gathered A @ B_i for up to 3 B's in one pass over A.

    a_local: (M_loc, K) this rank's shard; a_slots: (WORLD, M_loc, K) where slot s holds
    rank s's shard once flags[flag_base + s*256 + chunk] >= epoch (chunk = row // chunk_rows).
    Tiles run slot by slot starting with this rank's own shard, then the shards in the order
    peers push them (rank-1, rank-2, ...), so early tiles never wait.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M_loc, BM)
    tn0 = tl.cdiv(N0, BN)
    tn1 = tl.cdiv(N1, BN)
    tiles_n = tn0 + tn1 + tl.cdiv(N2, BN)
    per_slot = tiles_m * tiles_n
    for t in range(pid, WORLD * per_slot, num_progs):
        order = t // per_slot
        slot = (rank - order + WORLD) % WORLD
        pid_m, pid_n = _tile_coords(t % per_slot, tiles_m, tiles_n, GROUP_M)
        i = pid_m * BM + tl.arange(0, BM)
        row_mask = i < M_loc
        if slot == rank:
            a_base = a_local
        else:
            last = tl.minimum(pid_m * BM + BM, M_loc) - 1
            chunk = last // chunk_rows
            spin_geq(flags + flag_base + slot * 256 + chunk, epoch, status, 2, slot, chunk, bound, DEBUG)
            a_base = a_slots + slot.to(tl.int64) * M_loc * K
        # Pick the B this column tile belongs to (uniform per tile, so a scalar branch).
        b, c, bias, sbk, sbn, n_i, col = b0, c0, bias0, sbk0, sbn0, N0, pid_n
        if NUM_B > 1:
            if pid_n >= tn0:
                b, c, bias, sbk, sbn, n_i, col = b1, c1, bias1, sbk1, sbn1, N1, pid_n - tn0
        if NUM_B > 2:
            if pid_n >= tn0 + tn1:
                b, c, bias, sbk, sbn, n_i, col = b2, c2, bias2, sbk2, sbn2, N2, pid_n - tn0 - tn1
        offs_n = col * BN + tl.arange(0, BN)
        n_mask = offs_n < n_i
        acc = _mainloop(a_base, i, row_mask, b, sbk, sbn, offs_n, n_mask, K, BM, BN, BK, EVEN_K)
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        rows = _block_rows(slot, i, LIN, WORLD)
        c_ptrs = c + rows.to(tl.int64)[:, None] * n_i + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _fence_proxy_async():
    """Order this thread's earlier generic-proxy accesses (the flag's acquire) before its
    later async-proxy ones (TMA loads of the data the flag guards)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def _tma_acc(a_desc, a_row, b_desc, n0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             B_KMAJOR: tl.constexpr):
    """acc[BM, BN] = A[a_row:+BM, :] @ B[:, n0:+BN] in fp32, tiles moved by the TMA unit.
    B_KMAJOR: b_desc describes B^T (N, K) (nn.Linear's weight), else B (K, N).  Out-of-bounds
    rows and columns of a tile read as zeros."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        a_blk = a_desc.load([a_row, kb * BK])
        if B_KMAJOR:
            b_blk = b_desc.load([n0, kb * BK]).T
        else:
            b_blk = b_desc.load([kb * BK, n0])
        acc = tl.dot(a_blk, b_blk, acc)
    return acc


@triton.jit
def _sweep_tile(lt, rank, per_slot, tiles_m, tiles_n, OWN: tl.constexpr, WORLD: tl.constexpr, GROUP_M: tl.constexpr):
    """(slot, pid_m, pid_n) of a sweep's local tile lt: this rank's own shard (OWN), or the
    peers' slots in arrival order rank-1, rank-2, ..."""
    if OWN:
        slot = rank
        local = lt
    else:
        slot = (rank - 1 - lt // per_slot + WORLD) % WORLD
        local = lt % per_slot
    pid_m, pid_n = _tile_coords(local, tiles_m, tiles_n, GROUP_M)
    return slot, pid_m, pid_n


@triton.jit
def _slot_wait(slot, pid_m, flags, status, epoch, bound, M_loc, chunk_rows, flag_base, BM: tl.constexpr,
               DEBUG: tl.constexpr):
    """Spin until the piece of slot `slot` holding row tile pid_m has landed, then order the
    flag's acquire before the TMA reads of it."""
    last = tl.minimum(pid_m * BM + BM, M_loc) - 1
    chunk = last // chunk_rows
    spin_geq(flags + flag_base + slot * 256 + chunk, epoch, status, 2, slot, chunk, bound, DEBUG)
    _fence_proxy_async()


@triton.jit
def _tma_sweep(g0, pid, num_progs, a_desc, b_desc, c, bias, n_i, flags, status, epoch, bound, M_loc, K, LIN, rank,
               chunk_rows, flag_base, OWN: tl.constexpr, WORLD: tl.constexpr, HAS_BIAS: tl.constexpr,
               B_KMAJOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               DEBUG: tl.constexpr, TMA_STORE: tl.constexpr, FLAT: tl.constexpr):
    """One phase of ag_gemm_tma_kernel: the tiles of one B over this rank's own shard (OWN) or
    over the peers' slots (in arrival order rank-1, rank-2, ...).  Phases number their tiles
    after the previous one's (g0 on): program pid takes the global tiles g = pid (mod
    num_progs), so no phase leaves a tail of idle programs.  TMA_STORE: c is a descriptor of the
    output [BM, BN] and every tile's rows one run of it (LIN a multiple of BM): the TMA unit
    stores the tile, asynchronously, where pointer stores from every thread held the next
    tile's loads back.  FLAT: the tile and k loops are one pipelined loop, so the next tile's
    first loads are in flight during this tile's last steps and its epilogue; a peer tile's
    flag is then awaited one tile ahead (the first before the loop, each next one at the start
    of the tile before it), which keeps every wait ahead of the loads it guards as long as a
    tile has enough k steps for the pipeline's stages (the host's condition, tma.flat_ok).
    Returns the next phase's g0."""
    tiles_m = tl.cdiv(M_loc, BM)
    tiles_n = tl.cdiv(n_i, BN)
    per_slot = tiles_m * tiles_n
    if OWN:
        count = per_slot
    else:
        count = (WORLD - 1) * per_slot
    first = ((pid - g0) % num_progs + num_progs) % num_progs
    if FLAT and not OWN:
        if first < count:
            slot0, m0, _n0 = _sweep_tile(first, rank, per_slot, tiles_m, tiles_n, OWN, WORLD, GROUP_M)
            _slot_wait(slot0, m0, flags, status, epoch, bound, M_loc, chunk_rows, flag_base, BM, DEBUG)
    for lt in tl.range(first, count, num_progs, flatten=FLAT):
        slot, pid_m, pid_n = _sweep_tile(lt, rank, per_slot, tiles_m, tiles_n, OWN, WORLD, GROUP_M)
        if OWN:
            a_row = pid_m * BM
        else:
            if FLAT:
                if lt + num_progs < count:
                    slot1, m1, _n1 = _sweep_tile(lt + num_progs, rank, per_slot, tiles_m, tiles_n, OWN, WORLD, GROUP_M)
                    _slot_wait(slot1, m1, flags, status, epoch, bound, M_loc, chunk_rows, flag_base, BM, DEBUG)
            else:
                _slot_wait(slot, pid_m, flags, status, epoch, bound, M_loc, chunk_rows, flag_base, BM, DEBUG)
            a_row = slot * M_loc + pid_m * BM
        acc = _tma_acc(a_desc, a_row, b_desc, pid_n * BN, K, BM, BN, BK, B_KMAJOR)
        i = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < n_i
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if TMA_STORE:
            i0 = pid_m * BM
            c.store([(i0 // LIN) * (WORLD * LIN) + slot * LIN + i0 % LIN, pid_n * BN], acc.to(c.dtype))
        else:
            rows = _block_rows(slot, i, LIN, WORLD)
            c_ptrs = c + rows.to(tl.int64)[:, None] * n_i + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(i < M_loc)[:, None] & n_mask[None, :])
    return g0 + count


@triton.jit(do_not_specialize=["epoch", "bound", "rank", "chunk_rows", "flag_base", "num_progs"])
def ag_gemm_tma_kernel(
    a_local, a_slots, flags, status, epoch, bound,
    b0, b1, b2, c0, c1, c2, bias0, bias1, bias2, N0, N1, N2,
    M_loc, K, LIN, rank, chunk_rows, flag_base, num_progs,
    WORLD: tl.constexpr, NUM_B: tl.constexpr, HAS_BIAS: tl.constexpr, B_KMAJOR: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DEBUG: tl.constexpr,
    TMA_STORE: tl.constexpr = False, FLAT: tl.constexpr = False,
):
    """ag_gemm_kernel with TMA loads: a_local (M_loc, K) and a_slots (WORLD * M_loc, K) and the
    B's are tensor descriptors (block [BM, BK], and [BN, BK] or [BK, BN]); c pointers as there,
    or with TMA_STORE descriptors of the outputs (block [BM, BN]: _tma_sweep); bias pointers
    as there (NUM_B of the three used; descriptors go as separate arguments: Triton 3.6's
    launcher refuses them inside tuples, so the kernel builds its tuples).  Same flag protocol;
    after a peer slot's flag the proxy fence orders the flag's acquire before the TMA reads.
    The tiles run as sequential phases (own shard x each B, then the peers x each B), one
    mainloop each: a descriptor cannot be picked per tile like a pointer, and mainloops in
    branches each keep their own shared-memory pipeline (2-6x the shared memory).  FLAT: each
    phase's loops are flattened, its waits one tile ahead (_tma_sweep)."""
    pid = tl.program_id(0)
    a_descs, b_descs, cs, biases, ns = (a_local, a_slots), (b0, b1, b2), (c0, c1, c2), (bias0, bias1, bias2), (N0, N1, N2)
    g = 0
    for phase in tl.static_range(2):  # 0: own shard, 1: the peers' slots
        for j in tl.static_range(NUM_B):
            g = _tma_sweep(g, pid, num_progs, a_descs[phase], b_descs[j], cs[j], biases[j], ns[j], flags, status,
                           epoch, bound, M_loc, K, LIN, rank, chunk_rows, flag_base, phase == 0, WORLD, HAS_BIAS,
                           B_KMAJOR, BM, BN, BK, GROUP_M, DEBUG, TMA_STORE, FLAT)


@triton.jit
def _rs_tile_out(acc, seg, pid_m, pid_n, out, bias, send, recv, recv_bases, flags, flag_bases, status, epoch, bound,
                 recv_off, data_base, N, M_seg, rank, chunk_mt, alpha, bias_scale, tiles_m,
                 WORLD: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, DEBUG: tl.constexpr, COUNTERS: tl.constexpr, DST_ALIGNED: tl.constexpr):
    """Where a reduce-scatter tile's fp32 product acc goes (rs_gemm_kernel's epilogue).
    DST_ALIGNED: the host vouches that a peer's slot starts 16-byte aligned, so the stores
    through a pointer read from recv_bases can be vectorized like those to a tensor argument."""
    i = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    seg_elems = M_seg.to(tl.int64) * N
    chunk = pid_m // chunk_mt
    offs = i.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (i < M_seg)[:, None] & n_mask[None, :]
    if seg != rank:
        if DIRECT:
            dst = tl.load(recv_bases + seg).to(tl.pointer_type(out.dtype.element_ty)) + recv_off + rank * seg_elems
            if DST_ALIGNED:
                dst = tl.multiple_of(dst, 16)
            tl.store(dst + offs, acc.to(out.dtype.element_ty), mask=mask)
            tl.debug_barrier()
            cnt = tl.load(flag_bases + seg).to(tl.pointer_type(tl.int32))
            tl.atomic_add(cnt + COUNTERS + rank * 256 + chunk, 1, sem="release", scope="sys")
        else:
            tl.store(send + seg * seg_elems + offs, acc.to(out.dtype.element_ty), mask=mask)
            tl.debug_barrier()
            tl.atomic_add(flags + COUNTERS + seg * 256 + chunk, 1, sem="release", scope="sys")
    else:
        tiles_in_chunk = tl.minimum(chunk_mt, tiles_m - chunk * chunk_mt) * tl.cdiv(N, BN)
        for step in range(1, WORLD):
            src = (rank - step + WORLD) % WORLD
            if DIRECT:
                spin_geq(flags + COUNTERS + src * 256 + chunk, tiles_in_chunk, status, 4, src, chunk, bound, DEBUG)
            else:
                spin_geq(flags + data_base + src * 256 + chunk, epoch, status, 3, src, chunk, bound, DEBUG)
            acc += tl.load(recv + src * seg_elems + offs, mask=mask, other=0.0).to(tl.float32)
        acc = acc * alpha
        if HAS_BIAS:
            acc += bias_scale * tl.load(bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["epoch", "bound", "recv_off", "data_base", "rank", "chunk_mt", "alpha", "bias_scale",
                               "num_progs"])
def rs_gemm_kernel(
    a, b, out, bias, send, recv, recv_bases, flags, flag_bases, status, epoch, bound, recv_off, data_base,
    sbk, sbn, N, K, M_seg, LIN, rank, chunk_mt, alpha, bias_scale, num_progs,
    WORLD: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DEBUG: tl.constexpr,
    COUNTERS: tl.constexpr, DST_ALIGNED: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
):
    """Reduce-scatter of A @ B by row blocks ("segments"): rank p gets segment p, summed.

    Segments are produced in the order rank+1, rank+2, ..., rank (own last), so every peer
    first computes what this rank needs.  A peer segment's tile goes either
      DIRECT: straight into peer p's recv slot `rank` (NVLink stores), then a release
              atomic on p's counter (p, chunk) at system scope; or
      copy engine: into local `send` slot p, then a release atomic on the local counter the
              side stream's copy waits for (the copy then sets p's DATA flag,
              flags[data_base + rank*256 + chunk], to `epoch`).
    Own-segment tiles wait for each peer's partial of the same chunk, add it in fp32,
    scale (avg) and add the bias, and store the result: the reduction is the epilogue.

    TMA: a and b are tensor descriptors (A (rows, K) with block [BM, BK]; B as in
    ag_gemm_tma_kernel, B_KMAJOR) and the tiles move by the TMA unit; sbk, sbn and EVEN_K are
    unused.  A tile's rows must then be one contiguous run of A (the host checks: one outer
    block, or LIN a multiple of BM); rows of a last, partial tile past the segment are read
    (the next segment's, or zeros past the tensor) and their results masked.  The flags are
    only touched after the mainloop, so it may be pipelined like any GEMM's.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M_seg, BM)
    tiles_n = tl.cdiv(N, BN)
    per_seg = tiles_m * tiles_n
    for t in range(pid, WORLD * per_seg, num_progs):
        seg = (rank + 1 + t // per_seg) % WORLD
        pid_m, pid_n = _tile_coords(t % per_seg, tiles_m, tiles_n, GROUP_M)
        if TMA:
            acc = _tma_acc(a, _block_rows(seg, pid_m * BM, LIN, WORLD), b, pid_n * BN, K, BM, BN, BK, B_KMAJOR)
        else:
            i = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            acc = _mainloop(a, _block_rows(seg, i, LIN, WORLD), i < M_seg, b, sbk, sbn, offs_n, offs_n < N, K, BM, BN,
                            BK, EVEN_K)
        _rs_tile_out(acc, seg, pid_m, pid_n, out, bias, send, recv, recv_bases, flags, flag_bases, status, epoch,
                     bound, recv_off, data_base, N, M_seg, rank, chunk_mt, alpha, bias_scale, tiles_m, WORLD, DIRECT,
                     HAS_BIAS, BM, BN, DEBUG, COUNTERS, DST_ALIGNED)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _copy_rows_kernel(src, dst, numel, BLOCK: tl.constexpr):
    """Grid-stride copy with 16-byte accesses; dst may be a peer's memory (NVLink stores)."""
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, blocks: int) -> None:
    """dst.copy_(src) for contiguous tensors with `blocks` SM blocks (the SM-split producer)."""
    _copy_rows_kernel[(blocks,)](src, dst, src.numel(), BLOCK=8192, num_warps=8)
