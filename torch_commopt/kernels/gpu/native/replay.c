/* Host replay of a GPU schedule's call: the driver operations and cuBLAS GEMMs that one eager
 * call queued, recorded once by kernels/gpu/host_replay.py and queued again here for a later call
 * whose tensors sit elsewhere.  No CUDA header and no link-time library: the entry points
 * (the driver's and cuBLAS's, or a test's fakes) are handed in by commopt_replay_init.
 *
 * A trace is an array of steps of WORDS int64 each.  A device address is a (base, offset) pair:
 * base 0 is absolute (symmetric buffers, flags), base i > 0 the i-th tensor of the call
 * (bases[i], its data pointer this call).  Word 0 is the step's kind, word 1 its stream.  A value
 * the recording saw change with the call's epoch (a barrier's, a kernel's argument) is marked and
 * queued with this call's epoch. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define WORDS 24
enum { MEMCPY = 1, MEMCPY2D = 2, RECORD = 3, WAIT_EVENT = 4, WAIT32 = 5, WRITE32 = 6, BATCH = 7, GEMM = 8, AXPY = 9,
       CALL = 10 };
#define MAX_CALL_WORDS 64 /* a native launcher's argument words (kernels/matmul/gpu/sm90.py) */
#define EPOCH_BASE (-1)   /* a CALL word relocated to this call's epoch, not into a tensor */
enum { F_MEMCPY, F_MEMCPY2D, F_RECORD, F_WAIT_EVENT, F_WAIT32, F_WRITE32, F_BATCH, F_SET_STREAM, F_GEMM,
       F_GEMM_BATCHED, F_AXPY, F_COUNT };

typedef int (*memcpy_t)(uint64_t, uint64_t, size_t, void *);
typedef int (*memcpy2d_t)(const void *, void *);
typedef int (*record_t)(void *, void *);
typedef int (*wait_event_t)(void *, void *, unsigned);
typedef int (*value32_t)(void *, uint64_t, uint32_t, unsigned);
typedef int (*batch_t)(void *, unsigned, void *, unsigned);
typedef int (*set_stream_t)(void *, void *);
typedef int (*gemm_t)(void *, int, int, int, int, int, const void *, const void *, int, int, const void *, int, int,
                      const void *, void *, int, int, int, int);
typedef int (*gemm_batched_t)(void *, int, int, int, int, int, const void *, const void *, int, int, long long,
                              const void *, int, int, long long, const void *, void *, int, int, long long, int, int,
                              int);
typedef int (*axpy_t)(void *, int, const void *, int, const void *, int, int, void *, int, int, int);
typedef int (*launcher_t)(const int64_t *);

static void *fns[F_COUNT];

/* CUDA_MEMCPY2D, as kernels/gpu/driver.py's _Memcpy2D */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    uint64_t srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    uint64_t dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} memcpy2d_desc;

#define COMPUTE_32F 68       /* CUBLAS_COMPUTE_32F */
#define DEFAULT_TENSOR_OP 99 /* CUBLAS_GEMM_DEFAULT_TENSOR_OP */
#define BATCH_VALUE_OFFSET 16 /* CUstreamBatchMemOpParams: the value's byte offset in one 48-byte op */

void commopt_replay_init(void *const *entry_points) {
    for (int i = 0; i < F_COUNT; i++) fns[i] = entry_points[i];
}

static inline uint64_t at(const int64_t *bases, int64_t base, int64_t offset) {
    return (uint64_t)(bases[base] + offset);
}

static int gemm(const int64_t *w, const int64_t *bases) {
    void *stream = (void *)w[1], *handle = (void *)w[2];
    float alpha, beta;
    int32_t a32 = (int32_t)w[22], b32 = (int32_t)w[23];
    memcpy(&alpha, &a32, 4);
    memcpy(&beta, &b32, 4);
    int rc = ((set_stream_t)fns[F_SET_STREAM])(handle, stream);
    if (rc) return rc;
    const void *A = (const void *)at(bases, w[8], w[9]), *B = (const void *)at(bases, w[12], w[13]);
    void *C = (void *)at(bases, w[16], w[17]);
    int dtype = (int)w[21];
    if (w[20] == 0)
        return ((gemm_t)fns[F_GEMM])(handle, (int)w[3], (int)w[4], (int)w[5], (int)w[6], (int)w[7], &alpha, A, dtype,
                                     (int)w[10], B, dtype, (int)w[14], &beta, C, dtype, (int)w[18], COMPUTE_32F,
                                     DEFAULT_TENSOR_OP);
    return ((gemm_batched_t)fns[F_GEMM_BATCHED])(handle, (int)w[3], (int)w[4], (int)w[5], (int)w[6], (int)w[7], &alpha,
                                                 A, dtype, (int)w[10], w[11], B, dtype, (int)w[14], w[15], &beta, C,
                                                 dtype, (int)w[18], w[19], (int)w[20], COMPUTE_32F, DEFAULT_TENSOR_OP);
}

/* y += alpha * x over n contiguous elements, in fp32 (cublasAxpyEx): an elementwise add of ATen's */
static int axpy(const int64_t *w, const int64_t *bases) {
    void *stream = (void *)w[1], *handle = (void *)w[2];
    float alpha;
    int32_t a32 = (int32_t)w[9];
    memcpy(&alpha, &a32, 4);
    int rc = ((set_stream_t)fns[F_SET_STREAM])(handle, stream);
    if (rc) return rc;
    int dtype = (int)w[8];
    return ((axpy_t)fns[F_AXPY])(handle, (int)w[3], &alpha, 0 /* CUDA_R_32F */, (const void *)at(bases, w[4], w[5]),
                                 dtype, 1, (void *)at(bases, w[6], w[7]), dtype, 1, 0);
}

/* A launcher of ours called with the recorded argument words, its relocated ones set for this call:
 * w[2] the launcher, w[3] / w[4] the words and their count, w[5] / w[6] (word index, base) pairs and
 * their count (base EPOCH_BASE: the word is the call's epoch, else the recorded offset into tensor
 * base, or an absolute address for base 0). */
static int call(const int64_t *w, const int64_t *bases, uint32_t epoch) {
    int64_t args[MAX_CALL_WORDS];
    int64_t n = w[4];
    const int64_t *relocs = (const int64_t *)w[5];
    if (n > MAX_CALL_WORDS) return -2;
    memcpy(args, (const int64_t *)w[3], (size_t)n * 8);
    for (int64_t i = 0; i < w[6]; i++) {
        int64_t word = relocs[2 * i], base = relocs[2 * i + 1];
        args[word] = base == EPOCH_BASE ? (int64_t)epoch : (int64_t)at(bases, base, args[word]);
    }
    return ((launcher_t)w[2])(args);
}

static int step(const int64_t *w, const int64_t *bases, uint32_t call_value, uint32_t epoch) {
    void *stream = (void *)w[1];
    switch (w[0]) {
    case MEMCPY:
        return ((memcpy_t)fns[F_MEMCPY])(at(bases, w[2], w[3]), at(bases, w[4], w[5]), (size_t)w[6], stream);
    case MEMCPY2D: {
        memcpy2d_desc d;
        memset(&d, 0, sizeof d);
        d.dstMemoryType = d.srcMemoryType = 2; /* CU_MEMORYTYPE_DEVICE */
        d.dstDevice = at(bases, w[2], w[3]);
        d.srcDevice = at(bases, w[4], w[5]);
        d.dstPitch = (size_t)w[6];
        d.srcPitch = (size_t)w[7];
        d.WidthInBytes = (size_t)w[8];
        d.Height = (size_t)w[9];
        return ((memcpy2d_t)fns[F_MEMCPY2D])(&d, stream);
    }
    case RECORD:
        return ((record_t)fns[F_RECORD])((void *)w[2], stream);
    case WAIT_EVENT:
        return ((wait_event_t)fns[F_WAIT_EVENT])(stream, (void *)w[2], 0);
    case WAIT32: /* w[5]: the value is the call's epoch */
        return ((value32_t)fns[F_WAIT32])(stream, at(bases, w[2], w[3]), w[5] ? epoch : (uint32_t)w[4], 0);
    case WRITE32:
        return ((value32_t)fns[F_WRITE32])(stream, at(bases, w[2], w[3]), w[5] ? epoch : (uint32_t)w[4], 0);
    case BATCH: {
        char *params = (char *)w[2];
        unsigned count = (unsigned)w[3];
        if (w[4]) { /* the last operation writes this call's own value (the watchdog's call number) */
            uint64_t v = call_value;
            memcpy(params + 48 * (count - 1) + BATCH_VALUE_OFFSET, &v, 8);
        }
        for (unsigned i = 0; i < count && i < 64; i++) { /* w[5]: a bit per operation writing the epoch */
            if ((uint64_t)w[5] >> i & 1) {
                uint64_t v = epoch;
                memcpy(params + 48 * i + BATCH_VALUE_OFFSET, &v, 8);
            }
        }
        return ((batch_t)fns[F_BATCH])(stream, count, params, 0);
    }
    case GEMM:
        return gemm(w, bases);
    case AXPY:
        return axpy(w, bases);
    case CALL:
        return call(w, bases, epoch);
    default:
        return -1;
    }
}

/* Queue the n steps; 0, or (index of the failing step + 1) << 32 | its error code. */
int64_t commopt_replay(const int64_t *steps, int64_t n, const int64_t *bases, uint32_t call_value, uint32_t epoch) {
    for (int64_t i = 0; i < n; i++) {
        int rc = step(steps + i * WORDS, bases, call_value, epoch);
        if (rc) return ((i + 1) << 32) | (uint32_t)rc;
    }
    return 0;
}
