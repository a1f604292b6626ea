// The fused reduce-scatter producer GEMM for Hopper (sm_90a): one persistent, warp-specialized
// kernel (sm90_common.cuh), its consumer warpgroups cooperative, the CUDA counterpart of
// triton_kernels.rs_gemm_kernel.
//
// A (world * m_seg rows in runs of lin per segment) @ B^T, reduce-scattered by row segments: rank p
// gets segment p, summed.  Segments are produced in the order rank+1, rank+2, ..., rank (own last),
// so every peer first computes what this rank needs.  A peer segment's tile is staged in shared
// memory and stored by the TMA unit through that segment's tensor map: straight into the peer's
// receive slot `rank` (direct, NVLink stores) or into the local send buffer the copy engine ships
// (store=ce).  The tile is released at system scope on the peer's counter (direct) or the local
// one the side stream's copy waits for once its stores have completed, which the warpgroups
// check after the next tile's mainloop (or at the kernel's end): the stores run under that
// mainloop instead of being waited for.  An own-segment tile waits for each peer's partial of
// its chunk, adds it in fp32, scales (avg), adds the bias and is stored by the TMA unit: the
// reduction is the epilogue.  The flags are touched only after a tile's mainloop, so the producer
// never waits on them.
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

// The most ranks a launch takes: a tensor map per destination segment rides in the parameters.
constexpr int MAX_RANKS = 8;

struct RsParams {
  CUtensorMap a;    // A (world * m_seg, K), box [BM, BK]
  CUtensorMap b;    // B^T (N, K), box [BN, BK]
  CUtensorMap out;  // this rank's reduced segment (m_seg, N), box [BOX, BOX]
  CUtensorMap recv_map;  // the receive slots as (world * m_seg, N), box [BOX, BOX], as `out`
  CUtensorMap dst[MAX_RANKS];  // segment s's destination (m_seg, N), box [BOX, BOX], as `out`
  const __nv_bfloat16* bias;  // or null
  float alpha, bias_scale;
  const long long* flag_bases;  // (world,) every rank's flags, device addresses
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

// A peer tile whose stores are in flight: the counter its release adds `count` to (null: none).
struct Sent {
  int* counter = nullptr;
  int count = 0;
};

// Release a sent tile: each warpgroup's leader waits for its TMA stores to complete and orders
// them before the generic proxy's release; once both have, one thread adds the tile's count to
// the counter at system scope.
__device__ void release_tile(Sent& sent) {
  if (sent.counter == nullptr) return;
  if (wg_leader()) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __threadfence_system();
  }
  tile_barrier();
  if (tile_leader()) {
    __threadfence_system();
    atomicAdd_system(sent.counter, sent.count);
  }
  sent.counter = nullptr;
}

// Whether peer src's partial of the chunk holding row tile pid_m has landed (direct: the peer's
// tile count of the chunk; store=ce: the copy's DATA flag), the acquire then ordered before the
// TMA unit's reads.  wait: spin until it has (true on return); else look once.
__device__ bool partial_landed(const RsParams& p, int src, int pid_m, bool wait) {
  int chunk = pid_m / p.chunk_mt;
  int tiles_in_chunk = min(p.chunk_mt, p.tiles_m - chunk * p.chunk_mt) * ((p.n + COUNT_BN - 1) / COUNT_BN);
  const int* flag = p.flags + (p.direct ? p.counters : p.data_base) + src * 256 + chunk;
  int expected = p.direct ? tiles_in_chunk : p.epoch;
  if (wait) {
    spin_geq(flag, expected, p.status, p.bound, p.direct ? 4 : 3, src, chunk);
    return true;
  }
  if (ld_acquire_sys(flag) - expected < 0) return false;
  asm volatile("fence.proxy.async.global;" ::: "memory");
  return true;
}

// The leader's load of a landed partial into its warpgroup's staging boxes, in the layout
// stage_tile writes: one bulk load a box instead of 4-byte global loads whose latency the
// warpgroup would wait out.  Rows past the segment read the next segment's rows or zeros: they are
// never stored.  begin_partial readies the boxes (the last tile's stores have read them, after
// this warpgroup's reads of them) and arms the barrier for all of them; load_box queues box c.
__device__ void begin_partial(const Shared& sh, int wg) {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(&sh.staged[wg], BN * 64 * 2);
}

__device__ __forceinline__ void load_box(const RsParams& p, const Shared& sh, uint8_t* mine, int src, int pid_m,
                                         int col0, int wg, int c) {
  tma_load(mine + c * BOX_BYTES, &p.recv_map, &sh.staged[wg], col0 + c * BOX, src * p.m_seg + pid_m * BM + wg_row0(wg));
}

// An own tile's first partial, spread over its mainloop (mma_k_steps' hook, the leader's): at the
// first round where it has landed, the boxes are armed and the first queued, then one more box a
// round, so that its bytes come in beside the mainloop's loads rather than as one burst.
// `queued` boxes are in flight when the mainloop ends (add_landed queues the rest).
struct SpreadPartial {
  const RsParams& p;
  const Shared& sh;
  uint8_t* mine;
  int src, pid_m, col0, wg;
  int queued = 0;
  bool on;  // this warpgroup's leader, on an own tile with peers
  __device__ __forceinline__ void operator()() {
    if (!on || queued == BN / BOX) return;
    if (queued == 0) {
      if (!partial_landed(p, src, pid_m, false)) return;
      begin_partial(sh, wg);
    }
    load_box(p, sh, mine, src, pid_m, col0, wg, queued++);
  }
};

// An own-segment tile's partials, peer by peer (rank-1, rank-2, ...), through the staging boxes:
// each but the last added here, the last left landed in the boxes for stage_tile<true> to add as it
// stages the tile.  `queued`: the first one's boxes the mainloop's hook queued (its flag seen).
// `loads` counts the warpgroup's loads into its boxes (the barrier's parity).
__device__ void add_landed(const RsParams& p, const Shared& sh, float (&d)[ACC], int pid_m, int col0, int wg, int& loads,
                           int queued) {
  uint8_t* mine = wg_staging(sh, wg);
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  for (int step = 1; step < p.world; ++step) {
    int src = (p.rank - step + p.world) % p.world;
    if (wg_leader()) {
      int from = step == 1 ? queued : 0;
      if (from == 0) {
        partial_landed(p, src, pid_m, true);
        begin_partial(sh, wg);
      }
      for (int c = from; c < BN / BOX; ++c) load_box(p, sh, mine, src, pid_m, col0, wg, c);
    }
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
  Ring r;
  float d[ACC];
  int loads = 0;
  Sent sent;
  for (int t = blockIdx.x; t < p.world * p.tiles_m * p.tiles_n; t += gridDim.x) {
    RsTile tile = rs_decode(p, t);
    int row0 = tile.pid_m * BM, col0 = tile.pid_n * BN, chunk = tile.pid_m / p.chunk_mt;
    int row = row0 + wg_row0(wg) < p.m_seg ? row0 + wg_row0(wg) : -1;  // the warpgroup's rows, or none
    // An own tile's first partial loads while the tile's mainloop runs, where it has landed.
    SpreadPartial spread{p, sh, mine, (p.rank - 1 + p.world) % p.world, tile.pid_m, col0, wg};
    spread.on = p.world > 1 && tile.seg == p.rank && wg_leader();
    mma_k_steps(d, sh, r, 0, nk, wg, spread);
    release_tile(sent);  // the last tile's stores ran under this mainloop
    if (tile.seg != p.rank) {
      stage_tile(mine, d, 1.f, nullptr, 0.f, col0, p.n, wg);
      if (wg_leader()) store_staged(&p.dst[tile.seg], mine, col0, p.n, row);
      sent.counter = p.direct ? reinterpret_cast<int*>(p.flag_bases[tile.seg]) + p.counters + p.rank * 256 + chunk
                              : p.flags + p.counters + tile.seg * 256 + chunk;
      sent.count = counted(p.n, col0);
      continue;
    }
    add_landed(p, sh, d, tile.pid_m, col0, wg, loads, spread.queued);
    if (p.world > 1)
      stage_tile<true>(mine, d, p.alpha, p.bias, p.bias_scale, col0, p.n, wg);
    else
      stage_tile(mine, d, p.alpha, p.bias, p.bias_scale, col0, p.n, wg);
    if (wg_leader()) store_staged(&p.out, mine, col0, p.n, row);
  }
  release_tile(sent);
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
// multiple of 8, 16-byte aligned bases, pitches, receive slots and destinations, every tile's rows
// one run of A (lin a multiple of 128, or lin == m_seg), at most MAX_RANKS ranks.  a: (world *
// m_seg, k) with row pitch a_pitch; out (m_seg, n) contiguous; recv (world, m_seg, n); dst
// (world,): where segment s's (m_seg, n) rows go, row pitch n (the peer's receive slot `rank`, or
// the local send buffer's segment s; dst[rank] unused); counters / data_base: flag indices
// (symm.COUNTERS, the call's DATA flags).  Returns 0, or a CUresult / cudaError_t code (the launch
// is not queued).
int commopt_sm90_rs_gemm(const void* a, long long a_pitch, const void* b, long long b_pitch, int n, int k, void* out,
                         const void* bias, float alpha, float bias_scale, const void* recv,
                         const long long* flag_bases, int* flags, int* status, long long bound, int m_seg, int lin,
                         int world, int rank, int chunk_mt, int data_base, int epoch, int counters, int direct,
                         int group_m, int grid, void* stream, const long long* dst) {
  if (world > MAX_RANKS) return (int)CUDA_ERROR_INVALID_VALUE;
  RsParams p;
  memset(&p, 0, sizeof(p));
  CUresult r = encode(&p.a, a, (long long)world * m_seg, k, a_pitch, BM);
  if (r == CUDA_SUCCESS) r = encode(&p.b, b, n, k, b_pitch, BN);
  if (r == CUDA_SUCCESS) r = encode(&p.out, out, m_seg, n, n, BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
  if (r == CUDA_SUCCESS)
    r = encode(&p.recv_map, recv, (long long)world * m_seg, n, n, BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
  for (int s = 0; s < world && r == CUDA_SUCCESS; ++s)
    if (s != rank)
      r = encode(&p.dst[s], reinterpret_cast<const void*>(dst[s]), m_seg, n, n, BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
  if (r != CUDA_SUCCESS) return (int)r;
  p.bias = static_cast<const __nv_bfloat16*>(bias);
  p.alpha = alpha, p.bias_scale = bias_scale;
  p.flag_bases = flag_bases;
  p.flags = flags, p.status = status, p.bound = bound;
  p.n = n, p.k = k, p.m_seg = m_seg, p.lin = lin, p.world = world, p.rank = rank, p.chunk_mt = chunk_mt;
  p.data_base = data_base, p.epoch = epoch, p.counters = counters, p.direct = direct, p.group_m = group_m;
  p.tiles_m = (m_seg + BM - 1) / BM;
  p.tiles_n = (n + BN - 1) / BN;
  return launch(rs_gemm_sm90, p, grid, stream);
}

// The same launch with its arguments as one int64 array (sm90.py's RS_WORDS order: the arguments
// above, alpha and bias_scale as their float bits, then dst's MAX_RANKS words): what sm90.py calls,
// and what a host replay calls by address with one call's values (kernels/gpu/native/replay.c).
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
                              static_cast<const long long*>(ptr(11)), static_cast<int*>(ptr(12)),
                              static_cast<int*>(ptr(13)), w[14], i32(15), i32(16), i32(17), i32(18), i32(19), i32(20),
                              i32(21), i32(22), i32(23), i32(24), i32(25), ptr(26), w + 27);
}

}  // extern "C"
