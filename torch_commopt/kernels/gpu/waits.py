"""Flag waits on the GPU: every spin on a peer's signal goes through `spin_geq`.

A consumer loads a flag with an acquire atomic at system scope before it loads the data the
flag guards; the producer (a peer's copy engine, a stream memory operation or a peer kernel's
release) wrote the data first.  Debug mode bounds every spin in wall time and records
(code, src, chunk, seen, expected) in `status`; `bounded_wait` is one such bounded spin as a
kernel of its own (the host-side wait of the runtime's debug mode).
"""

from __future__ import annotations

import triton
import triton.language as tl
import triton.language.extra.cuda as cuda_extra


@triton.jit
def spin_geq(ptr, expected, status, code, src, chunk, bound, DEBUG: tl.constexpr):
    """Spin until *ptr >= expected (int32 wrap-around compare); acquire, system scope.
    DEBUG: give up after `bound` nanoseconds of wall time (not iterations: a peer that is
    JIT-compiling a kernel for seconds is slow, not stuck)."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    if DEBUG:
        deadline = cuda_extra.globaltimer() + bound
        while ((v - expected) < 0) & (cuda_extra.globaltimer() < deadline):
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        if (v - expected) < 0:
            tl.store(status + 1, code)
            tl.store(status + 2, src)
            tl.store(status + 3, chunk)
            tl.store(status + 4, v)
            tl.store(status + 5, expected)
            tl.atomic_xchg(status, 1, sem="release", scope="gpu")
    else:
        while (v - expected) < 0:
            v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


# Every integer argument unspecialized: one compiled variant, loaded before any spinning
# kernel runs (GroupRuntime.load_debug_kernel).  Loading a module while one of our kernels
# spins waits for that kernel, and the kernel may be waiting for this very wait.
@triton.jit(do_not_specialize=["index", "expected", "code", "src", "chunk", "bound"])
def _bounded_wait_kernel(flags, index, expected, status, code, src, chunk, bound):
    spin_geq(flags + index, expected, status, code, src, chunk, bound, DEBUG=True)


def bounded_wait(flags, index, expected, status, *, code, src, chunk, bound) -> None:
    """One block spinning on flags[index] >= expected for at most `bound` nanoseconds."""
    _bounded_wait_kernel[(1,)](flags, index, expected, status, code, src, chunk, bound, num_warps=1)
