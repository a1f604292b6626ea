"""Triton kernels launched through their compiled binary, without the JIT's per-call dispatch.

`kernel[grid](...)` binds every argument, computes the specialization key, looks the binary up
and only then launches: tens of microseconds of host time a call, where the launch itself is a
few.  On a path where the GPU waits for the host (by_expert's run copies after the counts' host
read) that is the cost that sets the pace.  `Launcher` keeps each binary the JIT compiled under
a key of its own that holds everything the JIT specializes on, and launches it directly:

- a tensor: its dtype and whether its address is 16-byte aligned;
- an int: its integer type (32- or 64-bit, signed), and, unless the kernel marks it
  `do_not_specialize`, whether it equals 1 and whether it divides by 16;
- a bool or a float: its type; constexprs and launch options (num_warps, ...): their values.

Anything else (None, a tuple, a launch hook installed by a profiler, Triton's CPU interpreter)
takes the JIT's own path, as does the first call of each key, which compiles.  Since Triton 3.3 the
binary's launcher takes every declared argument in signature order, constexprs included
(it ignores their values), which is what `__call__` passes.
"""

from __future__ import annotations

import os

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # before Triton 3.4 the launch hooks were CompiledKernel's
    _knobs = None

_I32 = (-(2 ** 31), 2 ** 31)


def _int_kind(v: int, fixed: bool) -> tuple:
    kind = "i32" if _I32[0] <= v < _I32[1] else ("u64" if v >= 2 ** 63 else "i64")
    return (kind,) if fixed else (kind, v == 1, v % 16 == 0)


class Launcher:
    """`Launcher(fn)(grid, *args, **constexprs_and_options)` runs the triton.jit function `fn` as
    `fn[grid](*args, **kw)` would: positional args in signature order, then the rest by name."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.names = list(fn.arg_names)
        dns = getattr(fn, "do_not_specialize", ()) or ()
        fixed = {self.names[i] if isinstance(i, int) else i for i in dns}
        self._fixed = [n in fixed for n in self.names]
        self._binaries: dict[tuple, object] = {}
        self.fast_calls = 0  # launches that skipped the JIT's dispatch (for tests and probes)

    def _key(self, args: tuple, kw: dict) -> tuple | None:
        if any(n not in kw for n in self.names[len(args):]):  # a default left to the JIT
            return None
        spec = []
        for a, fixed in zip(args, self._fixed):
            if isinstance(a, torch.Tensor):
                spec.append((a.dtype, a.data_ptr() % 16 == 0))
            elif isinstance(a, bool):
                spec.append(("i1",))
            elif isinstance(a, int):
                spec.append(_int_kind(a, fixed))
            elif isinstance(a, float):
                spec.append(("fp32",))
            else:
                return None
        return (torch.cuda.current_device(), tuple(spec), tuple(sorted(kw.items())))

    def __call__(self, grid: tuple, *args, **kw) -> None:
        key = self._key(args, kw) if _fast_allowed() else None
        binary = self._binaries.get(key) if key is not None else None
        if binary is None:
            compiled = self.fn[grid](*args, **kw)
            if key is not None and _launchable(compiled):
                self._binaries[key] = compiled
            return
        values = list(args) + [kw[n] for n in self.names[len(args):]]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        enter, leave = _hooks()
        binary.run(grid[0], g1, g2, torch.cuda.current_stream().cuda_stream, binary.function,
                   binary.packed_metadata, None, enter, leave, *values)
        self.fast_calls += 1


def _hooks() -> tuple:
    """Triton's launch hooks, as the JIT passes them to a binary's launcher."""
    if _knobs is not None:
        return _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    from triton.compiler import CompiledKernel

    return CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook


def _idle(hook) -> bool:
    """No hook, or an empty chain of them (Triton 3.9 keeps a HookChain where 3.6 keeps None)."""
    return hook is None or (hasattr(hook, "calls") and not hook.calls)


def _fast_allowed() -> bool:
    """Not under Triton's CPU interpreter, and with no launch hook installed (a profiler's, which
    wants the launch's metadata)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return all(_idle(h) for h in _hooks())


def _launchable(compiled) -> bool:
    """Whether the JIT returned a binary this module knows how to launch (Triton >= 3.3)."""
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
