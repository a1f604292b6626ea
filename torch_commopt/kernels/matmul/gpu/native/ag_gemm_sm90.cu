// The fused all-gather consumer GEMM for Hopper (sm_90a): one persistent, warp-specialized
// kernel. out_i[full rows] = gathered A @ B_i^T for up to three K-major B's (nn.Linear's weights).
//
// A block of 384 threads: warpgroup 0 produces (one thread issues the TMA loads of each k step
// into a ring of STAGES shared-memory stages), warpgroups 1 and 2 consume (each multiplies 64 of
// the tile's 128 rows by its 256 columns with wgmma, accumulating in registers).  Tiles run slot
// by slot, this rank's own shard first, then the peers' in the order they push (rank-1, ...),
// grouped GROUP_M row tiles at a time so that column tiles of B stay in L2.  Before it loads a
// peer's rows the producer spins on the piece's arrival flag (acquire, system scope; then a
// proxy fence orders that acquire before the TMA unit's reads), so the consumers never wait on
// a flag themselves, only on the stage's full barrier.  Each tile's output is staged in shared
// memory and stored by the TMA unit while the warpgroups go on to the next tile, where a
// warpgroup's 64 rows are one run of the output (lin and M_loc multiples of 64); else by pointers.
//
// Memory ordering of the flags is the Triton kernels' (triton_kernels.py): the peer's copy
// engine wrote the rows, then the flag, with a fenced stream write.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

#ifndef COMMOPT_STAGES
#define COMMOPT_STAGES 3
#endif
#ifndef COMMOPT_TMA_STORE
#define COMMOPT_TMA_STORE 1
#endif
#ifndef COMMOPT_CLUSTER
#define COMMOPT_CLUSTER 1
#endif
#ifndef COMMOPT_PASS_COLS
#define COMMOPT_PASS_COLS 256
#endif
constexpr int BM = 128, BN = 256, BK = 64, STAGES = COMMOPT_STAGES, MAX_B = 3;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int THREADS = 384, CONSUMER_WARPS = 8;
// CLUSTER blocks (a cluster) take CLUSTER row tiles of the same column tile: each loads its own A
// and 1 / CLUSTER of the shared B tile, multicast by the TMA unit into every block of the cluster,
// so B crosses from L2 once for all of them.  Built with 1 (no cluster): 2 measured no faster on
// one H200 at the training step's GEMMs (docs/gpu-schedules.md).
constexpr int CLUSTER = COMMOPT_CLUSTER, B_PART = BN / CLUSTER;
constexpr int MIN_SHARE = 4;  // fewest k steps a block's stream-K share may have
// The output tile staged for the TMA store: per consumer warpgroup 64 rows x PASS_COLS columns at a
// time, as 64 x 64 boxes with 128-byte swizzle (8 KB each).
constexpr int BOX = 64, BOX_BYTES = BOX * BOX * 2, PASS_COLS = COMMOPT_PASS_COLS;
constexpr int C_BYTES = COMMOPT_TMA_STORE ? BM * PASS_COLS * 2 : 0;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + C_BYTES + 1024;  // + slack to align the stages to 1024 B
static_assert(SMEM_BYTES <= 227 * 1024, "the stages and the output tile exceed a block's shared memory");

struct Params {
  CUtensorMap a_own;    // this rank's shard (M_loc, K), box [BM, BK], 128-byte swizzle
  CUtensorMap a_slots;  // every rank's slot (world * M_loc, K)
  CUtensorMap b[MAX_B]; // B_i^T (N_i, K), box [B_PART, BK]
  CUtensorMap out[MAX_B];  // the outputs (rows, N_i), box [BOX, BOX], 128-byte swizzle (tma_store)
  __nv_bfloat16* c[MAX_B];
  const __nv_bfloat16* bias[MAX_B];
  int n[MAX_B], tn[MAX_B];
  int* flags;
  int* status;
  long long bound;  // debug waits: give up after this many ns (0: spin until the flag is raised)
  int m_loc, k, lin, world, rank, chunk_rows, flag_base, epoch;
  int num_b, tiles_m, tiles_n, group_m;
  int total;  // units of work: CLUSTER row tiles of one column tile of one slot
  int tma_store;  // every warpgroup's 64 rows one run of an output (lin and m_loc multiples of 64)
  // Stream-K tail (CLUSTER 1): the first `full` tiles run whole, a round of the grid at a time; the
  // k steps of the last `tail` tiles (fewer than the grid) are dealt evenly over all blocks. A
  // block whose share starts inside a tile leaves its fp32 partial in workspace[block] and counts
  // it in counters[tile]; the tile's owner (the block holding its first k step) adds them in.
  int full, tail;
  float* workspace;
  int* counters;
};

// A block's next piece of work: k steps [kb0, kb1) of tile `tile`; `partial`: a share left to the
// tile's owner; else the block stores the tile, after adding the partials of `helpers` blocks
// (blockIdx.x + 1, ...) when it owns a stream-K tile.
struct Unit {
  int tile, kb0, kb1, helpers;
  bool partial;
};

struct Walk {
  int t;              // the next whole tile
  long long pos, end; // the block's stream-K share: k steps pos .. end of the tail tiles
};

__device__ __forceinline__ long long owner_of(long long pos, long long total) {
  return ((pos + 1) * gridDim.x + total - 1) / total - 1;  // the block whose share holds k step pos
}

__device__ __forceinline__ Walk walk_start(const Params& p, int nk) {
  Walk w;
  long long total = (long long)p.tail * nk;
  w.t = blockIdx.x / CLUSTER;
  w.pos = blockIdx.x * total / gridDim.x;
  w.end = (blockIdx.x + 1) * total / gridDim.x;
  return w;
}

__device__ __forceinline__ bool next_unit(const Params& p, int nk, Walk& w, Unit& u) {
  if (w.t < p.full) {
    u = {w.t, 0, nk, 0, false};
    w.t += gridDim.x / CLUSTER;
    return true;
  }
  if (w.pos >= w.end) return false;
  long long total = (long long)p.tail * nk;
  int j = (int)(w.pos / nk), kb0 = (int)(w.pos % nk);
  int kb1 = (int)min((long long)nk, kb0 + (w.end - w.pos));
  u = {p.full + j, kb0, kb1, 0, kb0 != 0};
  if (!u.partial) u.helpers = (int)(owner_of((long long)(j + 1) * nk - 1, total) - blockIdx.x);
  w.pos += kb1 - kb0;
  return true;
}

struct Tile {
  int slot, pid_m, bi, col;
};

// Work unit t of this block: rank `cta` of its cluster takes row tile pid_m = CLUSTER * m + cta of
// the unit's CLUSTER row tiles (one past the last row tile reads rows it never stores).
__device__ __forceinline__ Tile decode(const Params& p, int t, int cta) {
  Tile r;
  int tiles_m = (p.tiles_m + CLUSTER - 1) / CLUSTER;
  int per_slot = tiles_m * p.tiles_n;
  int phase = t / per_slot, local = t - phase * per_slot;
  r.slot = (p.rank - phase + p.world) % p.world;
  int width = p.group_m * p.tiles_n;
  int first_m = (local / width) * p.group_m;
  int size_m = min(tiles_m - first_m, p.group_m);
  r.pid_m = (first_m + (local % width) % size_m) * CLUSTER + cta;
  r.col = (local % width) / size_m;
  r.bi = 0;
  if (p.num_b > 1 && r.col >= p.tn[0]) {
    r.col -= p.tn[0];
    r.bi = 1;
    if (p.num_b > 2 && r.col >= p.tn[1]) {
      r.col -= p.tn[1];
      r.bi = 2;
    }
  }
  return r;
}

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Arrive on the barrier at the same offset in block `cta` of this cluster.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, int cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_u32(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__device__ __forceinline__ int cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return (int)r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  uint32_t done = 0;
  uint32_t addr = smem_u32(bar);
  while (!done) {
    asm volatile(
        "{\n .reg .pred P;\n mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n selp.u32 %0, 1, 0, P;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// The same box into every block of the cluster (ctaMask), each block's barrier at the same offset.
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  uint16_t mask = (1u << CLUSTER) - 1;
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}

__device__ __forceinline__ int ld_acquire_sys(const int* ptr) {
  int v;
  asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ long long globaltimer() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spin until *ptr >= expected (int32 wrap-around compare), as waits.spin_geq does; with a bound,
// give up after `bound` ns and record (code, src, chunk, seen, expected) in status.
__device__ void spin_geq(const Params& p, const int* ptr, int expected, int src, int chunk) {
  int v = ld_acquire_sys(ptr);
  if (p.bound > 0) {
    long long deadline = globaltimer() + p.bound;
    while (v - expected < 0 && globaltimer() < deadline) v = ld_acquire_sys(ptr);
    if (v - expected < 0) {
      p.status[1] = 2;
      p.status[2] = src;
      p.status[3] = chunk;
      p.status[4] = v;
      p.status[5] = expected;
      __threadfence();
      atomicExch(p.status, 1);
    }
  } else {
    while (v - expected < 0) v = ld_acquire_sys(ptr);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// wgmma matrix descriptor of a K-major tile with 128-byte swizzle: rows of 128 bytes, 8-row
// groups 1024 bytes apart; the stage buffers are 1024-byte aligned (base offset 0).
__device__ __forceinline__ uint64_t sw128_desc(const void* ptr) {
  uint64_t addr = smem_u32(ptr);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(accumulate));
}

__device__ __forceinline__ void fence_operands(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void store_tile(const Params& p, const Tile& t, float (&d)[128], int wg) {
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  int n_i = p.n[t.bi];
  __nv_bfloat16* c = p.c[t.bi];
  const __nv_bfloat16* bias = p.bias[t.bi];
  int col0 = t.col * BN + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    int i = t.pid_m * BM + wg * 64 + warp * 16 + lane / 4 + 8 * j;
    if (i >= p.m_loc) continue;
    long long row = (long long)(i / p.lin) * p.world * p.lin + (long long)t.slot * p.lin + i % p.lin;
    __nv_bfloat16* out = c + row * n_i;
#pragma unroll
    for (int q = 0; q < 32; ++q) {
      int col = col0 + 8 * q;
      if (col < n_i) {
        float v0 = d[4 * q + 2 * j], v1 = d[4 * q + 2 * j + 1];
        if (bias != nullptr) {
          v0 += __bfloat162float(bias[col]);
          v1 += __bfloat162float(bias[col + 1]);
        }
        *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v0, v1);
      }
    }
  }
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

// The epilogue by the TMA unit: the warpgroup writes its 64 x 256 accumulators (+ bias) as bf16
// into its staging boxes, PASS_COLS columns at a time; one thread queues each pass's box stores
// and, once the last pass is queued, the warpgroup goes on to the next tile while they drain.
// A pass reuses the staging boxes once the stores before it have read them.
__device__ void store_tile_tma(const Params& p, const Tile& t, float (&d)[128], int wg, uint8_t* staging) {
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  uint8_t* mine = staging + wg * (BM / 2) * PASS_COLS * 2;
  int n_i = p.n[t.bi];
  const __nv_bfloat16* bias = p.bias[t.bi];
  int i = t.pid_m * BM + wg * 64;
  int row = (i / p.lin) * p.world * p.lin + t.slot * p.lin + i % p.lin;
#pragma unroll
  for (int pass = 0; pass < BN / PASS_COLS; ++pass) {
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    named_barrier(1 + wg, 128);
#pragma unroll
    for (int qq = 0; qq < PASS_COLS / 8; ++qq) {
      int q = pass * (PASS_COLS / 8) + qq;
      int col = t.col * BN + 8 * q + 2 * (lane % 4);
      float b0 = 0.f, b1 = 0.f;
      if (bias != nullptr && col < n_i) b0 = __bfloat162float(bias[col]), b1 = __bfloat162float(bias[col + 1]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        int r = warp * 16 + lane / 4 + 8 * j;  // r % 8 == lane / 4: the swizzle's phase
        uint32_t off = (qq / 8) * BOX_BYTES + r * 128 + (((qq % 8) ^ (lane / 4)) * 16) + (lane % 4) * 4;
        *reinterpret_cast<__nv_bfloat162*>(mine + off) =
            __floats2bfloat162_rn(d[4 * q + 2 * j] + b0, d[4 * q + 2 * j + 1] + b1);
      }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_barrier(1 + wg, 128);
    if (tid == 0 && i < p.m_loc) {
      for (int b = 0; b < PASS_COLS / BOX; ++b) {
        int c0 = t.col * BN + pass * PASS_COLS + b * BOX;
        if (c0 < n_i) tma_store(&p.out[t.bi], mine + b * BOX_BYTES, c0, row);
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
}

__device__ void produce(const Params& p, uint8_t* stages, uint64_t* full, uint64_t* empty, int cta) {
  int nk = (p.k + BK - 1) / BK, s = 0, phase = 0;
  Walk w = walk_start(p, nk);
  for (Unit u; next_unit(p, nk, w, u);) {
    Tile tile = decode(p, u.tile, cta);
    const CUtensorMap* a = &p.a_own;
    int row0 = tile.pid_m * BM;
    if (tile.slot != p.rank) {
      int last = min(row0 + BM, p.m_loc) - 1;
      int chunk = last / p.chunk_rows;
      spin_geq(p, p.flags + p.flag_base + tile.slot * 256 + chunk, p.epoch, tile.slot, chunk);
      a = &p.a_slots;
      row0 += tile.slot * p.m_loc;
    }
    for (int kb = u.kb0; kb < u.kb1; ++kb) {
      mbar_wait(&empty[s], phase ^ 1);
      uint8_t* stage = stages + s * STAGE_BYTES;
      mbar_expect_tx(&full[s], STAGE_BYTES);
      tma_load(stage, a, &full[s], kb * BK, row0);
      uint8_t* b_part = stage + A_BYTES + cta * B_PART * BK * 2;
      if (CLUSTER == 1)
        tma_load(b_part, &p.b[tile.bi], &full[s], kb * BK, tile.col * BN);
      else
        tma_load_multicast(b_part, &p.b[tile.bi], &full[s], kb * BK, tile.col * BN + cta * B_PART);
      if (++s == STAGES) s = 0, phase ^= 1;
    }
  }
}

// The consumers' 256 threads (both warpgroups) at one barrier.
constexpr int CONSUMERS_BARRIER = 3;

// A stream-K share that does not start its tile: the accumulators into this block's workspace
// slot (each thread's registers as float4s, thread-minor: coalesced), then, once every consumer
// thread has stored, one release of the tile's counter.
__device__ void leave_partial(const Params& p, int j, float (&d)[128], int wg) {
  int tid = threadIdx.x % 128;
  float4* slot = reinterpret_cast<float4*>(p.workspace) + (size_t)blockIdx.x * (BM * BN / 4);
#pragma unroll
  for (int q = 0; q < 32; ++q)
    __stcg(slot + (wg * 32 + q) * 128 + tid, make_float4(d[4 * q], d[4 * q + 1], d[4 * q + 2], d[4 * q + 3]));
  named_barrier(CONSUMERS_BARRIER, 256);
  if (threadIdx.x == 128) {
    __threadfence();
    atomicAdd(p.counters + j, 1);
  }
}

// The owner of a stream-K tile: wait until its `helpers` blocks have left their partials, add
// them (in block order), and set the tile's counter back to 0 for the next launch.
__device__ void add_partials(const Params& p, int j, int helpers, float (&d)[128], int wg) {
  int tid = threadIdx.x % 128;
  if (threadIdx.x == 128) {
    while (ld_acquire_gpu(p.counters + j) < helpers) {
    }
    p.counters[j] = 0;
  }
  named_barrier(CONSUMERS_BARRIER, 256);
  for (int h = 1; h <= helpers; ++h) {
    const float4* slot = reinterpret_cast<const float4*>(p.workspace) + (size_t)(blockIdx.x + h) * (BM * BN / 4);
#pragma unroll
    for (int q = 0; q < 32; ++q) {
      float4 v = __ldcg(slot + (wg * 32 + q) * 128 + tid);
      d[4 * q] += v.x, d[4 * q + 1] += v.y, d[4 * q + 2] += v.z, d[4 * q + 3] += v.w;
    }
  }
}

// A stage is free once every consumer warp of every block of the cluster has read it (the blocks'
// producers write into each other's stages).
__device__ __forceinline__ void release(uint64_t* bar) {
  if (threadIdx.x % 32 != 0) return;
  if (CLUSTER == 1) {
    mbar_arrive(bar);
  } else {
#pragma unroll
    for (int c = 0; c < CLUSTER; ++c) mbar_arrive_cluster(bar, c);
  }
}

__device__ void consume(const Params& p, uint8_t* stages, uint64_t* full, uint64_t* empty, int wg, int cta) {
  uint8_t* staging = stages + STAGES * STAGE_BYTES;
  int nk = (p.k + BK - 1) / BK, s = 0, phase = 0;
  float d[128];
  Walk w = walk_start(p, nk);
  for (Unit u; next_unit(p, nk, w, u);) {
    Tile tile = decode(p, u.tile, cta);
    int prev = -1;
    for (int kb = u.kb0; kb < u.kb1; ++kb) {
      mbar_wait(&full[s], phase);
      uint8_t* a = stages + s * STAGE_BYTES + wg * 64 * BK * 2;
      uint8_t* b = stages + s * STAGE_BYTES + A_BYTES;
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma_m64n256k16(d, sw128_desc(a + kk * 32), sw128_desc(b + kk * 32), kb > u.kb0 || kk > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      if (prev >= 0) {
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        release(&empty[prev]);
      }
      prev = s;
      if (++s == STAGES) s = 0, phase ^= 1;
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_operands(d);
    release(&empty[prev]);
    if (u.partial) {
      leave_partial(p, u.tile - p.full, d, wg);
      continue;
    }
    if (u.helpers > 0) add_partials(p, u.tile - p.full, u.helpers, d, wg);
    if (COMMOPT_TMA_STORE && p.tma_store)
      store_tile_tma(p, tile, d, wg, staging);
    else
      store_tile(p, tile, d, wg);
  }
  if (COMMOPT_TMA_STORE && threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(THREADS, 1) ag_gemm_sm90(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], CONSUMER_WARPS * CLUSTER);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  // The cluster's barriers are initialized before any block multicasts into another.
  if (CLUSTER > 1)
    cluster_sync();
  else
    __syncthreads();
  int wg = threadIdx.x / 128, cta = CLUSTER > 1 ? cluster_rank() : 0;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) produce(p, stages, full, empty, cta);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    consume(p, stages, full, empty, wg - 1, cta);
  }
  // No block leaves while a peer may still arrive on its barriers.
  if (CLUSTER > 1) cluster_sync();
}

// A 2-D tensor map of a bf16 matrix (rows, cols) with row pitch `pitch` elements, box [box_rows,
// box_cols], 128-byte swizzle; out-of-bounds elements read as zeros (and are not stored).
// cuTensorMapEncodeTiled through the runtime's entry-point query: no link against libcuda.
typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static EncodeTiled fn = nullptr;
  if (fn == nullptr) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(ptr);
  }
  return fn;
}

CUresult encode(CUtensorMap* map, const void* base, long long rows, long long cols, long long pitch, int box_rows,
                int box_cols = BK) {
  EncodeTiled fn = encode_tiled();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)pitch * 2};
  cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides,
                                box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace

extern "C" {

// The clusters of the kernel that fit on the current device at once (a negative CUDA error code
// where the query fails).
int commopt_sm90_clusters(int grid) {
  static int fitting = 0;
  if (fitting == 0) {
    cudaError_t e = cudaFuncSetAttribute(ag_gemm_sm90, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (e != cudaSuccess) return -(int)e;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(max(CLUSTER, grid / CLUSTER * CLUSTER));
    config.blockDim = dim3(THREADS);
    config.dynamicSmemBytes = SMEM_BYTES;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = CLUSTER;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    e = cudaOccupancyMaxActiveClusters(&fitting, ag_gemm_sm90, &config);
    if (e != cudaSuccess) return -(int)e;
  }
  return fitting;
}

// Shapes the kernel takes: bf16 operands, K-major B's, 16-byte aligned bases and pitches, N_i even.
// workspace (grid x BM x BN fp32) and counters (grid int32, zero) for the stream-K tail, or null
// (whole tiles only; one pair per stream: a launch leaves the counters at zero).
// Returns 0, or a CUresult / cudaError_t code (the launch is not queued).
//   a_own (m_loc, k) pitch a_pitch; a_slots (world * m_loc, k) pitch s_pitch; bs[i] (ns[i], k) pitch
//   b_pitch[i]; cs[i] (rows, ns[i]) contiguous; biases[i] or null; flags / status int32 arrays.
int commopt_sm90_ag_gemm(const void* a_own, long long a_pitch, const void* a_slots, long long s_pitch, int m_loc,
                         int k, int world, int rank, int lin, int chunk_rows, int flag_base, int epoch, int* flags,
                         int* status, long long bound, int num_b, const void* const* bs, const long long* b_pitch,
                         const int* ns, void* const* cs, const void* const* biases, int group_m, int grid,
                         float* workspace, int* counters, void* stream) {
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(ag_gemm_sm90, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  Params p;
  bool tma_store = COMMOPT_TMA_STORE && lin % 64 == 0 && m_loc % 64 == 0;
  for (int i = 0; i < num_b; ++i) tma_store = tma_store && reinterpret_cast<uintptr_t>(cs[i]) % 16 == 0;
  p.tma_store = tma_store;
  CUresult r = encode(&p.a_own, a_own, m_loc, k, a_pitch, BM);
  if (r == CUDA_SUCCESS) r = encode(&p.a_slots, a_slots, (long long)world * m_loc, k, s_pitch, BM);
  p.tiles_n = 0;
  for (int i = 0; i < MAX_B; ++i) {
    bool used = i < num_b;
    if (used && r == CUDA_SUCCESS) r = encode(&p.b[i], bs[i], ns[i], k, b_pitch[i], B_PART);
    if (used && tma_store && r == CUDA_SUCCESS)
      r = encode(&p.out[i], cs[i], (long long)world * m_loc, ns[i], ns[i], BOX, BOX);
    p.c[i] = used ? static_cast<__nv_bfloat16*>(cs[i]) : nullptr;
    p.bias[i] = used ? static_cast<const __nv_bfloat16*>(biases[i]) : nullptr;
    p.n[i] = used ? ns[i] : 0;
    p.tn[i] = used ? (ns[i] + BN - 1) / BN : 0;
    p.tiles_n += p.tn[i];
  }
  if (r != CUDA_SUCCESS) return (int)r;
  p.flags = flags;
  p.status = status;
  p.bound = bound;
  p.m_loc = m_loc, p.k = k, p.lin = lin, p.world = world, p.rank = rank;
  p.chunk_rows = chunk_rows, p.flag_base = flag_base, p.epoch = epoch, p.num_b = num_b;
  p.tiles_m = (m_loc + BM - 1) / BM;
  p.group_m = group_m;
  p.total = world * ((p.tiles_m + CLUSTER - 1) / CLUSTER) * p.tiles_n;
  p.workspace = workspace;
  p.counters = counters;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(max(CLUSTER, grid / CLUSTER * CLUSTER));
  config.blockDim = dim3(THREADS);
  config.dynamicSmemBytes = SMEM_BYTES;
  config.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = CLUSTER;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  // A persistent grid must be co-resident: clusters take SMs of one GPC, where an odd count leaves
  // one out, so the grid is the clusters that fit at once.
  if (CLUSTER > 1) {
    int fitting = commopt_sm90_clusters(grid);
    if (fitting <= 0) return fitting < 0 ? -fitting : (int)cudaErrorInvalidConfiguration;
    config.gridDim = dim3(min((int)config.gridDim.x, fitting * CLUSTER));
  }
  // Stream-K for the last, partial round of tiles where at most half the blocks would have a tile
  // in it (the split saves the idle rest of that round, and costs each share its partial's trip
  // through L2 and the owner's wait), and each block's share is worth it.
  int blocks = (int)config.gridDim.x, nk = (k + BK - 1) / BK;
  int tail = p.total % blocks;
  bool streamk = CLUSTER == 1 && workspace != nullptr && counters != nullptr && tail > 0 && 2 * tail <= blocks &&
                 (long long)tail * nk / blocks >= MIN_SHARE;
  p.full = streamk ? p.total - tail : p.total;
  p.tail = streamk ? tail : 0;
  return (int)cudaLaunchKernelEx(&config, ag_gemm_sm90, p);
}

}  // extern "C"
