// What the sm_90a GEMM kernels share (ag_gemm_sm90.cu, rs_gemm_sm90.cu): the tile, the
// shared-memory ring of TMA-loaded stages with its full / empty barriers, the wgmma mainloop, the
// staging of a warpgroup's output in swizzled boxes, flag waits and tensor maps.
//
// A block has 384 threads: warpgroup 0 produces (one thread issues each k step's TMA loads into a
// ring of STAGES stages), warpgroups 1 and 2 consume, accumulating in fp32 registers.  The
// consumers are cooperative: both take every 128 x 256 tile, each its 64 rows, with wgmma
// m64n256k16, and share the tile's epilogue (the tensor cores idle while they store it).  Both
// kernels use this split: the widest tile, the fewest bytes through L2 a flop.
// A stage is released once the wgmma after it has been issued and the one reading it has completed.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// A k step: 64 of K (128-byte rows, swizzled at that width), in 3 stages (what shared memory holds
// beside the two warpgroups' staged output).  At the power cap, where these GEMMs run, a step's
// waits, releases and bookkeeping cost clock: 32 in 6 stages (more loads in flight) took fewer
// cycles, but ran at a lower clock.
constexpr int BM = 128, BN = 256, BK = 64, STAGES = 3;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int THREADS = 384, WG_WARPS = 4;
// A warpgroup's rows of a tile: 64, the first at row wg_row0(wg).  Its accumulators: d[4 * q +
// 2 * j + e] holds row 16 * warp + lane / 4 + 8 * j, column 8 * q + 2 * (lane % 4) + e of its rows
// (wgmma's fragment).
constexpr int ACC = BN / 2;
__device__ __forceinline__ int wg_row0(int wg) { return 64 * wg; }
// A warpgroup's output staged as four 64 x 64 bf16 boxes with 128-byte swizzle: box c holds
// columns 64 * c.. .
constexpr int BOX = 64, BOX_BYTES = BOX * BOX * 2, WG_STAGING = (BN / BOX) * BOX_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * WG_STAGING + 1024;  // + slack to align to 1024 B
static_assert(SMEM_BYTES + 256 <= 227 * 1024, "the stages and the output tiles exceed a block's shared memory");

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

// A barrier's wait by its shared-window address (the mainloop's: no generic-to-shared conversion
// a k step) and by pointer, and its arrive by address.  The wait's retry loop is inside the asm: a
// loop in C++ on the asm's result would be one whose exit the compiler cannot know to be
// warp-uniform, and what follows it would leave uniform registers.
__device__ __forceinline__ void mbar_wait_at(uint32_t addr, int parity) {
  asm volatile(
      "{\n .reg .pred P;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n @!P bra WAIT_%=;\n}\n"
      ::"r"(addr), "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  mbar_wait_at(smem_u32(bar), parity);
}

__device__ __forceinline__ void mbar_arrive_at(uint32_t addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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

// Spin until *ptr >= expected (int32 wrap-around compare), as waits.spin_geq does; with a bound > 0,
// give up after `bound` ns and record (code, src, chunk, seen, expected) in status.  Then order the
// acquire before the TMA unit's reads of what the flag guards.
__device__ void spin_geq(const int* ptr, int expected, int* status, long long bound, int code, int src, int chunk) {
  int v = ld_acquire_sys(ptr);
  if (bound > 0) {
    long long deadline = globaltimer() + bound;
    while (v - expected < 0 && globaltimer() < deadline) v = ld_acquire_sys(ptr);
    if (v - expected < 0) {
      status[1] = code;
      status[2] = src;
      status[3] = chunk;
      status[4] = v;
      status[5] = expected;
      __threadfence();
      atomicExch(status, 1);
    }
  } else {
    while (v - expected < 0) v = ld_acquire_sys(ptr);
  }
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// wgmma matrix descriptor of a K-major tile whose rows are BK * 2 bytes, swizzled at that width
// (as the TMA unit loaded it): 8-row groups 8 * BK * 2 bytes apart; the stage buffers are
// 1024-byte aligned (base offset 0).
constexpr uint64_t DESC_SWIZZLE = BK == 64 ? 1 : BK == 32 ? 2 : 3;  // 128-, 64-, 32-byte swizzle
constexpr CUtensorMapSwizzle OPERAND_SWIZZLE =
    BK == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : BK == 32 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_32B;
// Its low word holds the start address in 16-byte units (14 bits) and the leading-byte offset (1),
// the high word the 8-row groups' stride and the swizzle.  Shared memory ends below 256 KB, so the
// descriptor of address + off (a multiple of 16) is the low word plus off / 16: the mainloop adds
// constants to one base word a stage instead of building 16 descriptors a k step.
constexpr uint32_t DESC_HI = (uint32_t)(8 * BK * 2 >> 4) | (uint32_t)(DESC_SWIZZLE << 30);
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr) {
  return ((addr & 0x3FFFF) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t desc_of(uint32_t lo) {
  return ((uint64_t)DESC_HI << 32) | lo;
}

// wgmma's fp32 accumulator operands, eight at a time.
#define F8(i)                                                                                              \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
      "+f"(d[i + 7])

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
      : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56),
        F8(64), F8(72), F8(80), F8(88), F8(96), F8(104), F8(112), F8(120)
      : "l"(da), "l"(db), "r"(accumulate));
}
#undef F8

__device__ __forceinline__ void fence_operands(float (&d)[ACC]) {
#pragma unroll
  for (int i = 0; i < ACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The block's shared memory: the ring's stages (1024-byte aligned), its barriers, and each
// warpgroup's barrier for loads into its staging boxes; the full and empty barriers'
// shared-window addresses and stage 0's descriptor word, for the mainloop.
struct Shared {
  uint8_t* stages;
  uint64_t *full, *empty, *staged;
  uint32_t full_at, empty_at, stage0_lo;
};

// The ring's position: stage s, and the parity its barriers are in.
struct Ring {
  int s = 0, phase = 0;
  __device__ __forceinline__ void next() {
    if (++s == STAGES) s = 0, phase ^= 1;
  }
  // Past `steps` k steps.
  __device__ __forceinline__ void skip(int steps) {
    int at = s + steps;
    phase ^= (at / STAGES) & 1;
    s = at % STAGES;
  }
};

// The producer's k steps [kb0, kb1) of one tile: A's rows a_row.. (box [BM, BK]) and B^T's rows
// b_row.. (box [BN, BK]) into the ring, each stage once its consumer has released it.
__device__ void load_k_steps(const Shared& sh, Ring& r, const CUtensorMap* a, int a_row, const CUtensorMap* b,
                             int b_row, int kb0, int kb1) {
  for (int kb = kb0; kb < kb1; ++kb) {
    mbar_wait(&sh.empty[r.s], r.phase ^ 1);
    uint8_t* stage = sh.stages + r.s * STAGE_BYTES;
    mbar_expect_tx(&sh.full[r.s], STAGE_BYTES);
    tma_load(stage, a, &sh.full[r.s], kb * BK, a_row);
    tma_load(stage + A_BYTES, b, &sh.full[r.s], kb * BK, b_row);
    r.next();
  }
}

// One k step of a consumer warpgroup on stage S (a constant where the caller's loop is unrolled):
// wait for the stage to land, issue its wgmmas (four k16 steps) as one group, overwriting d at the
// tile's first step, and, past that step, release the stage before it once the group reading it
// is complete (one group stays in flight).
__device__ __forceinline__ void mma_stage(float (&d)[ACC], const Shared& sh, int S, int phase, uint32_t a_lo,
                                          bool first) {
  mbar_wait_at(sh.full_at + 8 * S, phase);
  const uint32_t lo = sh.stage0_lo + S * (STAGE_BYTES >> 4);
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk)
    wgmma_m64n256k16(d, desc_of(lo + a_lo + (kk * 32 >> 4)), desc_of(lo + ((A_BYTES + kk * 32) >> 4)),
                     !first || kk > 0);
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  if (!first) {
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    if (threadIdx.x % 32 == 0) mbar_arrive_at(sh.empty_at + 8 * ((S + STAGES - 1) % STAGES));
  }
}

// What a consumer does between two rounds of its mainloop: nothing by default.
struct NoHook {
  __device__ __forceinline__ void operator()() {}
};

// Consumer warpgroup wg's k steps [kb0, kb1) of its rows of a tile into d (overwritten at the
// first); d is final on return.
// The ring is walked a round of STAGES stages at a time, unrolled, so that each step's stage is
// a constant: its barriers' addresses and its descriptors are the block's base words plus
// constants, and a step costs little more than its wgmmas (at the power cap every instruction
// a k step issues costs clock).  hook() runs after each round but the last, its wgmmas in flight.
template <class Hook>
__device__ void mma_k_steps(float (&d)[ACC], const Shared& sh, Ring& r, int kb0, int kb1, int wg, Hook& hook) {
  const uint32_t a_lo = wg_row0(wg) * BK * 2 >> 4;  // the warpgroup's rows of A in the stage
  int kb = kb0, from = r.s, phase = r.phase;
  while (kb < kb1) {
#pragma unroll
    for (int S = 0; S < STAGES; ++S) {
      if (S >= from && kb < kb1) {
        mma_stage(d, sh, S, phase, a_lo, kb == kb0);
        ++kb;
      }
    }
    from = 0, phase ^= 1;
    if (kb < kb1) hook();
  }
  r.skip(kb1 - kb0);
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  fence_operands(d);
  if (threadIdx.x % 32 == 0) mbar_arrive_at(sh.empty_at + 8 * ((r.s + STAGES - 1) % STAGES));
}

__device__ __forceinline__ void mma_k_steps(float (&d)[ACC], const Shared& sh, Ring& r, int kb0, int kb1, int wg) {
  NoHook none;
  mma_k_steps(d, sh, r, kb0, kb1, wg, none);
}

__device__ __forceinline__ uint8_t* wg_staging(const Shared& sh, int wg) {
  return sh.stages + STAGES * STAGE_BYTES + wg * WG_STAGING;
}

// The consumer warpgroup's own named barrier (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void wg_barrier(int wg) {
  named_barrier(1 + wg, 128);
}

// The threads that share a tile's epilogue (both consumer warpgroups) meet, and the one of them
// that signals for the tile.
__device__ __forceinline__ void tile_barrier() {
  named_barrier(3, 256);
}

__device__ __forceinline__ bool tile_leader() {
  return threadIdx.x == 128;
}

// The thread of a consumer warpgroup that queues the TMA unit's work on its staging boxes.
__device__ __forceinline__ bool wg_leader() {
  return threadIdx.x % 128 == 0;
}

// A block of a kernel on the ring: its barriers set up, then warpgroup 0's first thread produces
// (with few registers) and warpgroups 1 and 2 consume (with the registers given up).
template <class P, void (*PRODUCE)(const P&, const Shared&), void (*CONSUME)(const P&, const Shared&, int)>
__device__ __forceinline__ void run_roles(const P& p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES], staged[2];
  uint8_t* stages = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  // The mainloop's base words broadcast from lane 0: warp-uniform values the compiler keeps (in
  // uniform registers) rather than rebuilding from the shared window each k step.
  Shared sh{stages, full, empty, staged, (uint32_t)__shfl_sync(0xffffffff, smem_u32(full), 0),
            (uint32_t)__shfl_sync(0xffffffff, smem_u32(empty), 0),
            (uint32_t)__shfl_sync(0xffffffff, desc_lo(smem_u32(stages)), 0)};
  if (threadIdx.x == 0) {
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], 2 * WG_WARPS);
    }
    mbar_init(&staged[0], 1);
    mbar_init(&staged[1], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // Broadcast from lane 0 so that the compiler knows the warpgroup, and so everything a consumer
  // derives from it and its ring, warp-uniform: the mainloop's descriptors then stay in uniform
  // registers instead of being built in each thread's and moved over a k step.
  int wg = __shfl_sync(0xffffffff, threadIdx.x / 128, 0);
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) PRODUCE(p, sh);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    CONSUME(p, sh, wg - 1);
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack_bf16(uint32_t w) {
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&w);
  return __bfloat1622float2(v);
}

// Four 8 x 8 bf16 matrices between shared memory and the accumulators' fragment (a thread holds
// row lane / 4, columns 2 * (lane % 4) and + 1 of each): lanes 8m .. 8m + 7 address matrix m's rows.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

// A warpgroup's accumulators, scaled by alpha, plus bias (scaled by bias_scale; null: none), as
// bf16 into its staging boxes, columns col0.. (bias read below n only), once the previous
// tile's TMA stores from them have read them; ends with the boxes visible to the TMA unit.  ADD:
// the boxes hold a bf16 partial in this layout (loaded by the TMA unit, landed): alpha * (acc +
// partial) + bias replaces it, each warp reading and rewriting the same matrices.
// By stmatrix (ldmatrix): a warp moves two 8-column groups of its 16 rows an instruction, matrix
// m = 2 * (group - q) + j holding rows 8j.. of column group q + m / 2; lane L addresses row L % 8
// of matrix L / 8, its 16 bytes at the box row's swizzled chunk.
template <bool ADD = false>
__device__ void stage_tile(uint8_t* mine, const float (&d)[ACC], float alpha, const __nv_bfloat16* bias,
                           float bias_scale, int col0, int n, int wg) {
  int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  int m = lane / 8, r8 = lane % 8;
  uint32_t row_at = smem_u32(mine) + (warp * 16 + 8 * (m % 2) + r8) * 128;
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  wg_barrier(wg);
#pragma unroll
  for (int q = 0; q < BN / 8; q += 2) {
    float b[4] = {0.f, 0.f, 0.f, 0.f};  // columns 8q + 2 (lane % 4) + {0, 1}, then 8 (q + 1) + ...
    if (bias != nullptr) {
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        int col = col0 + 8 * (q + g) + 2 * (lane % 4);
        if (col < n)
          b[2 * g] = bias_scale * __bfloat162float(bias[col]), b[2 * g + 1] = bias_scale * __bfloat162float(bias[col + 1]);
      }
    }
    uint32_t chunk = ((q % 8 + m / 2) ^ r8) * 16;  // this lane's 16 bytes in its box row
    uint32_t at = row_at + (q / 8) * BOX_BYTES + chunk;
    float v[8];  // d[4q + 4g + 2j + e]: column group q + g, rows 8j.., element e
#pragma unroll
    for (int x = 0; x < 8; ++x) v[x] = d[4 * q + x];
    if (ADD) {
      uint32_t w[4];
      ldmatrix_x4(at, w[0], w[1], w[2], w[3]);  // matrices (q, j0), (q, j1), (q+1, j0), (q+1, j1)
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        float2 p = unpack_bf16(w[x]);
        v[2 * x] += p.x, v[2 * x + 1] += p.y;
      }
    }
    uint32_t o[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) o[x] = pack_bf16(alpha * v[2 * x] + b[2 * (x / 2)], alpha * v[2 * x + 1] + b[2 * (x / 2) + 1]);
    stmatrix_x4(at, o[0], o[1], o[2], o[3]);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  wg_barrier(wg);
}

// The staged boxes' columns col0.. below n to the output's rows row.. by the TMA unit (none where
// row is negative); one thread of the warpgroup queues them as one bulk group.
__device__ __forceinline__ void store_staged(const CUtensorMap* out, const uint8_t* mine, int col0, int n, int row) {
  for (int c = 0; c < BN / BOX; ++c)
    if (row >= 0 && col0 + c * BOX < n) tma_store(out, mine + c * BOX_BYTES, col0 + c * BOX, row);
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

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

// A 2-D tensor map of a bf16 matrix (rows, cols) with row pitch `pitch` elements, box [box_rows,
// box_cols]: by default an operand's (box_cols BK, its swizzle); out-of-bounds elements read as
// zeros (and are not stored).
CUresult encode(CUtensorMap* map, const void* base, long long rows, long long cols, long long pitch, int box_rows,
                int box_cols = BK, CUtensorMapSwizzle swizzle = OPERAND_SWIZZLE) {
  EncodeTiled fn = encode_tiled();
  if (fn == nullptr) return CUDA_ERROR_NOT_FOUND;
  cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  cuuint64_t strides[1] = {(cuuint64_t)pitch * 2};
  cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  cuuint32_t elem[2] = {1, 1};
  return fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

// Launch `kernel` on `grid` blocks with the ring's shared memory (its limit raised once).
// The kernel loaded on the current device and its shared-memory limit raised.  Under CUDA's lazy
// loading a kernel's module is otherwise loaded at its first launch, and loading a module waits for
// the kernels running on the device, which may be spinning on what this rank has yet to send:
// the library calls this once when it is opened (sm90.library), before any of its launches.
template <class Kernel>
int ready(Kernel kernel) {
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  return 0;
}

// Launch `kernel` on `grid` blocks with the ring's shared memory.
template <class Kernel, class P>
int launch(Kernel kernel, const P& p, int grid, void* stream) {
  int e = ready(kernel);
  if (e != 0) return e;
  kernel<<<grid, THREADS, SMEM_BYTES, static_cast<cudaStream_t>(stream)>>>(p);
  return (int)cudaGetLastError();
}

}  // namespace
