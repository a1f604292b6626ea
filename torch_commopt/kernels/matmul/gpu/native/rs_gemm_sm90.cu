// The fused reduce-scatter producer GEMM for Hopper (sm_90a): one persistent, warp-specialized
// kernel (sm90_common.cuh), its consumer warpgroups cooperative, the CUDA counterpart of
// triton_kernels.rs_gemm_kernel.
//
// A (world * m_seg rows in runs of lin per segment) @ B^T, reduce-scattered by row segments: rank p
// gets segment p, summed.  Segments are produced in the order rank+1, rank+2, ..., rank (own last),
// so every peer first computes what this rank needs.  A peer segment's tile is staged in shared
// memory and written with 16-byte stores either straight into the peer's receive slot `rank`
// (direct, NVLink stores) or into the local send buffer the copy engine ships (store=ce); once
// every thread of both warpgroups has stored, one thread releases the tile at system scope on the
// peer's counter (direct) or the local one the side stream's copy waits for.  An own-segment tile
// waits for each peer's partial of its chunk, adds it in fp32, scales (avg), adds the bias and is
// stored by the TMA unit: the reduction is the epilogue.  The flags are touched only after a
// tile's mainloop, so the producer never waits on them.
#include "sm90_common.cuh"

#include <string.h>

namespace {

// The tiles a chunk's counter counts are BM x COUNT_BN, whatever this kernel's tile: the Triton
// kernel another rank may run instead (sm90.py's RS_BN) counts the same.
constexpr int COUNT_BN = 128;

// How many counted tiles the tile at column col0 covers.
__device__ __forceinline__ int counted(int n, int col0) {
  return (min(BN, n - col0) + COUNT_BN - 1) / COUNT_BN;
}

struct RsParams {
  CUtensorMap a;    // A (world * m_seg, K), box [BM, BK]
  CUtensorMap b;    // B^T (N, K), box [BN, BK]
  CUtensorMap out;  // this rank's reduced segment (m_seg, N), box [BOX, BOX]
  CUtensorMap recv_map;  // the receive slots as (world * m_seg, N), box [BOX, BOX], as `out`
  const __nv_bfloat16* bias;  // or null
  float alpha, bias_scale;
  __nv_bfloat16* send;          // (world, m_seg, N): store=ce's staging
  const __nv_bfloat16* recv;    // (world, m_seg, N): this rank's receive slots
  const long long* recv_bases;  // (world,) every rank's receive buffer, device addresses
  const long long* flag_bases;  // (world,) every rank's flags, device addresses
  long long recv_off;           // elements from a receive buffer's base to its slots
  int* flags;
  int* status;
  long long bound;  // debug waits: give up after this many ns (0: spin until the flag is raised)
  int n, k, m_seg, lin, world, rank, chunk_mt, data_base, epoch, counters, direct, group_m, tiles_m, tiles_n;
};

struct RsTile {
  int seg, pid_m, pid_n;
};

__device__ __forceinline__ RsTile rs_decode(const RsParams& p, int t) {
  RsTile r;
  int per_seg = p.tiles_m * p.tiles_n;
  r.seg = (p.rank + 1 + t / per_seg) % p.world;
  int local = t % per_seg, width = p.group_m * p.tiles_n;
  int first_m = (local / width) * p.group_m;
  int size_m = min(p.tiles_m - first_m, p.group_m);
  r.pid_m = first_m + (local % width) % size_m;
  r.pid_n = (local % width) / size_m;
  return r;
}

// A's row holding row i of segment seg (runs of lin rows, segments interleaved by run).
__device__ __forceinline__ int a_row(const RsParams& p, int seg, int i) {
  return (i / p.lin) * p.world * p.lin + seg * p.lin + i % p.lin;
}

// A peer segment's tile: the staged bf16 partial to `dst` (the segment's (m_seg, N) rows) with
// 16-byte stores, rows below m_seg and columns below n, then one release of `counter` at system
// scope once every thread on the tile has stored.
__device__ void send_tile(const RsParams& p, const uint8_t* mine, __nv_bfloat16* dst, int* counter, int row0,
                          int col0, int wg) {
  int tid = threadIdx.x % 128;
#pragma unroll 4
  for (int it = 0; it < 64 * BN / 8 / 128; ++it) {
    int id = it * 128 + tid, r = id / (BN / 8), ch = id % (BN / 8);  // the warpgroup's rows x chunks of 8 columns
    int row = row0 + wg_row0(wg) + r, col = col0 + ch * 8;
    if (row < p.m_seg && col < p.n) {
      int off = (ch / 8) * BOX_BYTES + r * 128 + ((ch % 8) ^ (r % 8)) * 16;  // stage_tile's swizzled layout
      uint4 v = *reinterpret_cast<const uint4*>(mine + off);
      *reinterpret_cast<uint4*>(dst + (long long)row * p.n + col) = v;
    }
  }
  tile_barrier();
  if (tile_leader()) {
    __threadfence_system();
    atomicAdd_system(counter, counted(p.n, col0));
  }
}

// The leader's load of peer src's partial of an own-segment tile into its warpgroup's staging
// boxes, in the layout stage_tile writes, once the partial has landed (direct: the peer's tile
// count of the chunk; store=ce: the copy's DATA flag) and the last tile's stores have read the
// boxes: one bulk load instead of 4-byte global loads whose latency the warpgroup would wait out.
// Rows past the segment read the next segment's rows or zeros: they are never stored.  wait: spin
// until it has landed; else look once and load only if it has (returns whether it loaded).
__device__ bool load_partial(const RsParams& p, const Shared& sh, uint8_t* mine, int src, int pid_m, int col0, int wg,
                             bool wait) {
  int chunk = pid_m / p.chunk_mt;
  int tiles_in_chunk = min(p.chunk_mt, p.tiles_m - chunk * p.chunk_mt) * ((p.n + COUNT_BN - 1) / COUNT_BN);
  const int* flag = p.flags + (p.direct ? p.counters : p.data_base) + src * 256 + chunk;
  int expected = p.direct ? tiles_in_chunk : p.epoch;
  if (wait) {
    spin_geq(flag, expected, p.status, p.bound, p.direct ? 4 : 3, src, chunk);
  } else {
    if (ld_acquire_sys(flag) - expected < 0) return false;
    asm volatile("fence.proxy.async.global;" ::: "memory");  // the acquire before the TMA unit's reads
  }
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // the last tile's stores have read them
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // after this warpgroup's reads of them
  mbar_expect_tx(&sh.staged[wg], BN * 64 * 2);
  for (int c = 0; c < BN / BOX; ++c)
    tma_load(mine + c * BOX_BYTES, &p.recv_map, &sh.staged[wg], col0 + c * BOX,
             src * p.m_seg + pid_m * BM + wg_row0(wg));
  return true;
}

// An own-segment tile's partials, peer by peer (rank-1, rank-2, ...), through the staging boxes:
// each but the last added here, the last left landed in the boxes for stage_tile<true> to add as it
// stages the tile.  `early`: the leader loaded the first one before the tile's mainloop.  `loads`
// counts the warpgroup's loads into its boxes (the barrier's parity).
__device__ void add_landed(const RsParams& p, const Shared& sh, float (&d)[ACC], int pid_m, int col0, int wg, int& loads,
                           bool early) {
  uint8_t* mine = wg_staging(sh, wg);
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  for (int step = 1; step < p.world; ++step) {
    if (wg_leader() && !(step == 1 && early))
      load_partial(p, sh, mine, (p.rank - step + p.world) % p.world, pid_m, col0, wg, true);
    mbar_wait(&sh.staged[wg], (loads++) & 1);
    if (step == p.world - 1) return;
#pragma unroll
    for (int q = 0; q < BN / 8; ++q)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        int r = warp * 16 + lane / 4 + 8 * j;  // the boxes' layout (stage_tile's), r % 8 == lane / 4
        uint32_t off = (q / 8) * BOX_BYTES + r * 128 + (((q % 8) ^ (lane / 4)) * 16) + (lane % 4) * 4;
        __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(mine + off);
        d[4 * q + 2 * j] += __low2float(v), d[4 * q + 2 * j + 1] += __high2float(v);
      }
    wg_barrier(wg);  // every thread has read the boxes before the next load writes them
  }
}

__device__ void rs_produce(const RsParams& p, const Shared& sh) {
  int nk = (p.k + BK - 1) / BK;
  Ring r;
  for (int t = blockIdx.x; t < p.world * p.tiles_m * p.tiles_n; t += gridDim.x) {
    RsTile tile = rs_decode(p, t);
    load_k_steps(sh, r, &p.a, a_row(p, tile.seg, tile.pid_m * BM), &p.b, tile.pid_n * BN, 0, nk);
  }
}

// A consumer warpgroup: its rows of each of the block's tiles.
__device__ void rs_consume(const RsParams& p, const Shared& sh, int wg) {
  uint8_t* mine = wg_staging(sh, wg);
  int nk = (p.k + BK - 1) / BK;
  long long seg_elems = (long long)p.m_seg * p.n;
  Ring r;
  float d[ACC];
  int loads = 0;
  for (int t = blockIdx.x; t < p.world * p.tiles_m * p.tiles_n; t += gridDim.x) {
    RsTile tile = rs_decode(p, t);
    int row0 = tile.pid_m * BM, col0 = tile.pid_n * BN, chunk = tile.pid_m / p.chunk_mt;
    // An own tile's first partial, if it has landed, loads while the tile's mainloop runs.
    bool early = p.world > 1 && tile.seg == p.rank && wg_leader() &&
                 load_partial(p, sh, mine, (p.rank - 1 + p.world) % p.world, tile.pid_m, col0, wg, false);
    mma_k_steps(d, sh, r, 0, nk, wg);
    if (tile.seg != p.rank) {
      stage_tile(mine, d, 1.f, nullptr, 0.f, col0, p.n, wg);
      __nv_bfloat16* dst = p.direct ? reinterpret_cast<__nv_bfloat16*>(p.recv_bases[tile.seg]) + p.recv_off +
                                          p.rank * seg_elems
                                    : p.send + tile.seg * seg_elems;
      int* counter = p.direct ? reinterpret_cast<int*>(p.flag_bases[tile.seg]) + p.counters + p.rank * 256 + chunk
                              : p.flags + p.counters + tile.seg * 256 + chunk;
      send_tile(p, mine, dst, counter, row0, col0, wg);
      continue;
    }
    add_landed(p, sh, d, tile.pid_m, col0, wg, loads, early);
    if (p.world > 1)
      stage_tile<true>(mine, d, p.alpha, p.bias, p.bias_scale, col0, p.n, wg);
    else
      stage_tile(mine, d, p.alpha, p.bias, p.bias_scale, col0, p.n, wg);
    if (wg_leader()) {
      int row = row0 + wg_row0(wg);
      store_staged(&p.out, mine, col0, p.n, row < p.m_seg ? row : -1);
    }
  }
  if (wg_leader()) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(THREADS, 1) rs_gemm_sm90(const __grid_constant__ RsParams p) {
  run_roles<RsParams, rs_produce, rs_consume>(p);
}

}  // namespace

extern "C" {

// The kernel loaded and configured on the current device (sm90_common.cuh's ready): 0, or a CUDA
// error code.
int commopt_sm90_rs_ready() { return ready(rs_gemm_sm90); }

// Shapes the kernel takes: bf16 operands, a K-major B (b: B^T (n, k) with row pitch b_pitch), n a
// multiple of 8, 16-byte aligned bases, pitches, receive slots and send rows, every tile's rows one
// run of A (lin a multiple of 128, or lin == m_seg).  a: (world * m_seg, k) with row pitch a_pitch;
// out (m_seg, n) contiguous; send / recv (world, m_seg, n); counters / data_base: flag indices
// (symm.COUNTERS, the call's DATA flags).  Returns 0, or a CUresult / cudaError_t code (the launch
// is not queued).
int commopt_sm90_rs_gemm(const void* a, long long a_pitch, const void* b, long long b_pitch, int n, int k, void* out,
                         const void* bias, float alpha, float bias_scale, void* send, const void* recv,
                         const long long* recv_bases, const long long* flag_bases, long long recv_off, int* flags,
                         int* status, long long bound, int m_seg, int lin, int world, int rank, int chunk_mt,
                         int data_base, int epoch, int counters, int direct, int group_m, int grid, void* stream) {
  RsParams p;
  CUresult r = encode(&p.a, a, (long long)world * m_seg, k, a_pitch, BM);
  if (r == CUDA_SUCCESS) r = encode(&p.b, b, n, k, b_pitch, BN);
  if (r == CUDA_SUCCESS) r = encode(&p.out, out, m_seg, n, n, BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
  if (r == CUDA_SUCCESS)
    r = encode(&p.recv_map, recv, (long long)world * m_seg, n, n, BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
  if (r != CUDA_SUCCESS) return (int)r;
  p.bias = static_cast<const __nv_bfloat16*>(bias);
  p.alpha = alpha, p.bias_scale = bias_scale;
  p.send = static_cast<__nv_bfloat16*>(send);
  p.recv = static_cast<const __nv_bfloat16*>(recv);
  p.recv_bases = recv_bases, p.flag_bases = flag_bases, p.recv_off = recv_off;
  p.flags = flags, p.status = status, p.bound = bound;
  p.n = n, p.k = k, p.m_seg = m_seg, p.lin = lin, p.world = world, p.rank = rank, p.chunk_mt = chunk_mt;
  p.data_base = data_base, p.epoch = epoch, p.counters = counters, p.direct = direct, p.group_m = group_m;
  p.tiles_m = (m_seg + BM - 1) / BM;
  p.tiles_n = (n + BN - 1) / BN;
  return launch(rs_gemm_sm90, p, grid, stream);
}

// The same launch with its arguments as one int64 array (sm90.py's RS_WORDS order: the arguments
// above, alpha and bias_scale as their float bits): what sm90.py calls, and what a host replay calls
// by address with one call's values (kernels/gpu/native/replay.c).
int commopt_sm90_rs_gemm_words(const long long* w) {
  auto ptr = [&](int i) { return reinterpret_cast<void*>(w[i]); };
  auto i32 = [&](int i) { return static_cast<int>(w[i]); };
  auto f32 = [&](int i) {
    int bits = static_cast<int>(w[i]);
    float f;
    memcpy(&f, &bits, 4);
    return f;
  };
  return commopt_sm90_rs_gemm(ptr(0), w[1], ptr(2), w[3], i32(4), i32(5), ptr(6), ptr(7), f32(8), f32(9), ptr(10),
                              ptr(11), static_cast<const long long*>(ptr(12)), static_cast<const long long*>(ptr(13)),
                              w[14], static_cast<int*>(ptr(15)), static_cast<int*>(ptr(16)), w[17], i32(18), i32(19),
                              i32(20), i32(21), i32(22), i32(23), i32(24), i32(25), i32(26), i32(27), i32(28),
                              ptr(29));
}

}  // extern "C"
