// The fused all-gather consumer GEMM for Hopper (sm_90a): one persistent, warp-specialized kernel
// (sm90_common.cuh), its consumer warpgroups cooperative.  out_i[full rows] = gathered A @ B_i^T
// for up to three K-major B's (nn.Linear's weights).
//
// Tiles run slot by slot, this rank's own shard first, then the peers' in the order they push
// (rank-1, ...), grouped GROUP_M row tiles at a time so that column tiles of B stay in L2.  Before
// it loads a peer's rows the producer spins on the piece's arrival flag (acquire, system scope;
// then a proxy fence orders that acquire before the TMA unit's reads), so the consumers never wait
// on a flag themselves, only on the stage's full barrier.  Each tile's output is staged in shared
// memory and stored by the TMA unit while the warpgroups go on to the next tile, where each 64 rows
// of a tile are one run of the output (lin and M_loc multiples of 64); else by pointers.
//
// Memory ordering of the flags is the Triton kernels' (triton_kernels.py): the peer's copy
// engine wrote the rows, then the flag, with a fenced stream write.
//
// Measured and not kept (docs/gpu-schedules.md): pointer stores from the accumulators for every
// tile, 4 stages with half the tile staged, clusters of two blocks multicasting B.
#include "sm90_common.cuh"

namespace {

constexpr int MAX_B = 3;
constexpr int MIN_SHARE = 256 / BK;  // fewest k steps a block's stream-K share may have (256 of K)

struct Params {
  CUtensorMap a_own;    // this rank's shard (M_loc, K), box [BM, BK], swizzled (OPERAND_SWIZZLE)
  CUtensorMap a_slots;  // every rank's slot (world * M_loc, K)
  CUtensorMap b[MAX_B]; // B_i^T (N_i, K), box [BN, BK]
  CUtensorMap out[MAX_B];  // the outputs (rows, N_i), box [BOX, BOX], 128-byte swizzle (tma_store)
  __nv_bfloat16* c[MAX_B];
  const __nv_bfloat16* bias[MAX_B];
  int n[MAX_B], tn[MAX_B];
  int* flags;
  int* status;
  long long bound;  // debug waits: give up after this many ns (0: spin until the flag is raised)
  int m_loc, k, lin, world, rank, chunk_rows, flag_base, epoch;
  int num_b, tiles_m, tiles_n, group_m, total;
  int tma_store;  // every 64-row half of a tile one run of an output (lin and m_loc multiples of 64)
  // Stream-K tail: the first `full` tiles run whole, a round of the grid at a time; the k steps of
  // the last `tail` tiles (fewer than the grid) are dealt evenly over all blocks. A block whose
  // share starts inside a tile leaves its fp32 partial in workspace[block] and counts it in
  // counters[tile]; the tile's owner (the block holding its first k step) adds them in.
  int full, tail;
  float* workspace;
  int* counters;
};

struct Tile {
  int slot, pid_m, bi, col;
};

__device__ __forceinline__ Tile decode(const Params& p, int t) {
  Tile r;
  int per_slot = p.tiles_m * p.tiles_n;
  int phase = t / per_slot, local = t - phase * per_slot;
  r.slot = (p.rank - phase + p.world) % p.world;
  int width = p.group_m * p.tiles_n;
  int first_m = (local / width) * p.group_m;
  int size_m = min(p.tiles_m - first_m, p.group_m);
  r.pid_m = first_m + (local % width) % size_m;
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
  w.t = blockIdx.x;
  w.pos = blockIdx.x * total / gridDim.x;
  w.end = (blockIdx.x + 1) * total / gridDim.x;
  return w;
}

__device__ __forceinline__ bool next_unit(const Params& p, int nk, Walk& w, Unit& u) {
  if (w.t < p.full) {
    u = {w.t, 0, nk, 0, false};
    w.t += gridDim.x;
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

// The output row holding row i of the gathered slot's shard (runs of lin rows, slots interleaved).
__device__ __forceinline__ long long out_row(const Params& p, int slot, int i) {
  return (long long)(i / p.lin) * p.world * p.lin + (long long)slot * p.lin + i % p.lin;
}

// The epilogue by pointers (where a 64-row half is not one run of an output): bf16 pairs from the
// accumulators (+ bias).
__device__ void store_tile(const Params& p, const Tile& t, float (&d)[ACC], int wg) {
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  int n_i = p.n[t.bi];
  const __nv_bfloat16* bias = p.bias[t.bi];
  int col0 = t.col * BN + 2 * (lane % 4);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    int i = t.pid_m * BM + wg_row0(wg) + warp * 16 + lane / 4 + 8 * j;
    if (i >= p.m_loc) continue;
    __nv_bfloat16* out = p.c[t.bi] + out_row(p, t.slot, i) * n_i;
#pragma unroll
    for (int q = 0; q < BN / 8; ++q) {
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

// The epilogue by the TMA unit: the warpgroup stages its rows of the tile (+ bias) and one thread
// queues their stores; the warpgroup goes on to its next tile while they drain.
__device__ void store_tile_tma(const Params& p, const Tile& t, float (&d)[ACC], int wg, uint8_t* mine) {
  stage_tile(mine, d, 1.f, p.bias[t.bi], 1.f, t.col * BN, p.n[t.bi], wg);
  if (wg_leader()) {
    int i = t.pid_m * BM + wg_row0(wg);
    store_staged(&p.out[t.bi], mine, t.col * BN, p.n[t.bi], i < p.m_loc ? (int)out_row(p, t.slot, i) : -1);
  }
}

__device__ void produce(const Params& p, const Shared& sh) {
  int nk = (p.k + BK - 1) / BK;
  Ring r;
  Walk w = walk_start(p, nk);
  for (Unit u; next_unit(p, nk, w, u);) {
    Tile tile = decode(p, u.tile);
    const CUtensorMap* a = &p.a_own;
    int row0 = tile.pid_m * BM;
    if (tile.slot != p.rank) {
      int last = min(row0 + BM, p.m_loc) - 1;
      int chunk = last / p.chunk_rows;
      spin_geq(p.flags + p.flag_base + tile.slot * 256 + chunk, p.epoch, p.status, p.bound, 2, tile.slot, chunk);
      a = &p.a_slots;
      row0 += tile.slot * p.m_loc;
    }
    load_k_steps(sh, r, a, row0, &p.b[tile.bi], tile.col * BN, u.kb0, u.kb1);
  }
}

// Where a warpgroup's float4s start in a workspace slot (one slot a block: a tile's partial).
__device__ __forceinline__ int wg_part(int wg) {
  return wg * ACC / 4;
}

// A stream-K share that does not start its tile: the accumulators into this block's workspace
// slot (each thread's registers as float4s, thread-minor: coalesced), then, once every thread on
// the tile has stored, one release of the tile's counter.
__device__ void leave_partial(const Params& p, int j, float (&d)[ACC], int wg) {
  int tid = threadIdx.x % 128;
  float4* slot = reinterpret_cast<float4*>(p.workspace) + (size_t)blockIdx.x * (BM * BN / 4);
#pragma unroll
  for (int q = 0; q < ACC / 4; ++q)
    __stcg(slot + (wg_part(wg) + q) * 128 + tid, make_float4(d[4 * q], d[4 * q + 1], d[4 * q + 2], d[4 * q + 3]));
  tile_barrier();
  if (tile_leader()) {
    __threadfence();
    atomicAdd(p.counters + j, 1);
  }
}

// The owner of a stream-K tile: wait until its `helpers` blocks have left their partials, add
// them (in block order), and set the tile's counter back to 0 for the next launch.
__device__ void add_partials(const Params& p, int j, int helpers, float (&d)[ACC], int wg) {
  int tid = threadIdx.x % 128;
  if (tile_leader()) {
    while (ld_acquire_gpu(p.counters + j) < helpers) {
    }
    p.counters[j] = 0;
  }
  tile_barrier();
  for (int h = 1; h <= helpers; ++h) {
    const float4* slot = reinterpret_cast<const float4*>(p.workspace) + (size_t)(blockIdx.x + h) * (BM * BN / 4);
#pragma unroll
    for (int q = 0; q < ACC / 4; ++q) {
      float4 v = __ldcg(slot + (wg_part(wg) + q) * 128 + tid);
      d[4 * q] += v.x, d[4 * q + 1] += v.y, d[4 * q + 2] += v.z, d[4 * q + 3] += v.w;
    }
  }
}

// A consumer warpgroup: its rows of each of the block's units.
__device__ void consume(const Params& p, const Shared& sh, int wg) {
  uint8_t* mine = wg_staging(sh, wg);
  int nk = (p.k + BK - 1) / BK;
  Ring r;
  float d[ACC];
  Walk w = walk_start(p, nk);
  for (Unit u; next_unit(p, nk, w, u);) {
    Tile tile = decode(p, u.tile);
    mma_k_steps(d, sh, r, u.kb0, u.kb1, wg);
    if (u.partial) {
      leave_partial(p, u.tile - p.full, d, wg);
      continue;
    }
    if (u.helpers > 0) add_partials(p, u.tile - p.full, u.helpers, d, wg);
    if (p.tma_store)
      store_tile_tma(p, tile, d, wg, mine);
    else
      store_tile(p, tile, d, wg);
  }
  if (wg_leader()) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__global__ void __launch_bounds__(THREADS, 1) ag_gemm_sm90(const __grid_constant__ Params p) {
  run_roles<Params, produce, consume>(p);
}

}  // namespace

extern "C" {

// The kernel loaded and configured on the current device (sm90_common.cuh's ready): 0, or a CUDA
// error code.
int commopt_sm90_ag_ready() { return ready(ag_gemm_sm90); }

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
  Params p;
  bool tma_store = lin % 64 == 0 && m_loc % 64 == 0;
  for (int i = 0; i < num_b; ++i) tma_store = tma_store && reinterpret_cast<uintptr_t>(cs[i]) % 16 == 0;
  p.tma_store = tma_store;
  CUresult r = encode(&p.a_own, a_own, m_loc, k, a_pitch, BM);
  if (r == CUDA_SUCCESS) r = encode(&p.a_slots, a_slots, (long long)world * m_loc, k, s_pitch, BM);
  p.tiles_n = 0;
  for (int i = 0; i < MAX_B; ++i) {
    bool used = i < num_b;
    if (used && r == CUDA_SUCCESS) r = encode(&p.b[i], bs[i], ns[i], k, b_pitch[i], BN);
    if (used && tma_store && r == CUDA_SUCCESS)
      r = encode(&p.out[i], cs[i], (long long)world * m_loc, ns[i], ns[i], BOX, BOX, CU_TENSOR_MAP_SWIZZLE_128B);
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
  p.total = world * p.tiles_m * p.tiles_n;
  p.workspace = workspace;
  p.counters = counters;
  // Stream-K for the last, partial round of tiles where at most half the blocks would have a tile
  // in it (the split saves the idle rest of that round, and costs each share its partial's trip
  // through L2 and the owner's wait), and each block's share is worth it.
  int nk = (k + BK - 1) / BK, tail = p.total % grid;
  bool streamk = workspace != nullptr && counters != nullptr && tail > 0 && 2 * tail <= grid &&
                 (long long)tail * nk / grid >= MIN_SHARE;
  p.full = streamk ? p.total - tail : p.total;
  p.tail = streamk ? tail : 0;
  return launch(ag_gemm_sm90, p, grid, stream);
}

// The same launch with its arguments as one int64 array (sm90.py's AG_WORDS order: the arguments
// above, each array as MAX_B words): what sm90.py calls, and what a host replay calls by address
// with one call's values (kernels/gpu/native/replay.c).
int commopt_sm90_ag_gemm_words(const long long* w) {
  const void* bs[MAX_B];
  long long pitches[MAX_B];
  int ns[MAX_B];
  void* cs[MAX_B];
  const void* biases[MAX_B];
  for (int i = 0; i < MAX_B; ++i) {
    bs[i] = reinterpret_cast<const void*>(w[16 + i]);
    pitches[i] = w[19 + i];
    ns[i] = static_cast<int>(w[22 + i]);
    cs[i] = reinterpret_cast<void*>(w[25 + i]);
    biases[i] = reinterpret_cast<const void*>(w[28 + i]);
  }
  auto ptr = [&](int i) { return reinterpret_cast<void*>(w[i]); };
  auto i32 = [&](int i) { return static_cast<int>(w[i]); };
  return commopt_sm90_ag_gemm(ptr(0), w[1], ptr(2), w[3], i32(4), i32(5), i32(6), i32(7), i32(8), i32(9), i32(10),
                              i32(11), static_cast<int*>(ptr(12)), static_cast<int*>(ptr(13)), w[14], i32(15), bs,
                              pitches, ns, cs, biases, i32(31), i32(32), static_cast<float*>(ptr(33)),
                              static_cast<int*>(ptr(34)), ptr(35));
}

}  // extern "C"
