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

POLLS: tl.constexpr = tl.constexpr(8)  # a bounded spin's polls of its flag per look at the clock (spin_geq)


@triton.jit
def spin_geq(ptr, expected, status, code, src, chunk, bound, DEBUG: tl.constexpr, ONCE: tl.constexpr = False):
    """Spin until *ptr >= expected (int32 wrap-around compare); acquire, system scope.
    DEBUG: give up after `bound` nanoseconds of wall time (not iterations: a peer that is
    JIT-compiling a kernel for seconds is slow, not stuck).  What the bound costs stays off the
    flag's path: nothing when the flag is there at the first look, else the clock read once per
    POLLS polls, so a flag that lands is seen as soon as unbounded.  ONCE: give up, without a
    record of its own, once another wait of the call gave up (status[0] set, read with the clock)
    -- waiting out another bound would only double the time to the error."""
    v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    if DEBUG:
        if (v - expected) < 0:
            deadline = cuda_extra.globaltimer() + bound
            live = (v - expected) < 0  # true here; a tensor, as the loop carries it
            while ((v - expected) < 0) & live:
                for _ in tl.static_range(POLLS):
                    if (v - expected) < 0:
                        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
                live = cuda_extra.globaltimer() < deadline
                if ONCE:
                    live = live & (tl.atomic_add(status, 0, sem="relaxed", scope="gpu") == 0)
            first = True
            if ONCE:
                first = tl.atomic_add(status, 0, sem="relaxed", scope="gpu") == 0
            if ((v - expected) < 0) & first:
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
