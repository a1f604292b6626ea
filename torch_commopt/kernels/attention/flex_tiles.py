"""The tiles of the flex backward kernels a context-parallel schedule runs, picked by measurement.

Inductor's default tiles for flex's backward suit dense masks over the whole sequence.  A rank's
call is another problem: its rows only, against every key (the all-gather schedule) or one
source's (the ring), and under a block-sparse mask (short documents, a window) each program of
the kernel has few tiles to visit.  Smaller tiles (SMALL) then run such a call faster, while they
lose on dense masks and on the whole sequence (docs/flex-attention.md#the-backwards-tiles).
Which wins follows the mask's sparsity, which changes with every batch's documents, and reading
it would cost a host sync a batch.  So the first call of a shape and mask function ("auto", the
default) runs each configuration -- compiling each once -- times it, and keeps the faster for
every later call with that key; TORCH_COMMOPT_FLEX_BWD_TILES=default or small fixes one.

The pick is a kernel's, not a schedule's: ranks may pick differently and still run the same
collectives.  Inside a CUDA-graph capture nothing can be timed: a key not yet measured runs the
default tiles there (logged once).  A configuration that fails to compile or run is logged and
left out.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

import torch

from torch_commopt.core import env
from torch_commopt.kernels.attention import switches

log = logging.getLogger(__name__)

# kernel_options of flex's backward template: dK/dV programs of 64 keys stepping 32 rows, dQ
# programs of 64 rows stepping 32 keys, 4 warps, 2 stages (all divide a 128-token mask block)
SMALL = {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 2}
CONFIGS: dict[str, dict] = {"default": {}, "small": SMALL}
REPS = 3  # timed calls a configuration, after one that compiles and warms it
_PICKED: dict[tuple, str] = {}


def mode() -> str:
    """What TORCH_COMMOPT_FLEX_BWD_TILES asks for: "auto", or a name of CONFIGS; an unknown value
    is logged once and read as "default"."""
    want = env.flex_bwd_tiles()
    if want != "auto" and want not in CONFIGS:
        switches.once(log, f"bad {want}", logging.WARNING, "commopt flex: %s=%r is not one of %s; using the "
                      "default tiles", env.FLEX_BWD_TILES, want, ("auto", *CONFIGS))
        return "default"
    return want


def run(key: tuple, call: Callable[[dict], object], what: str = ""):
    """call(options) with the picked configuration's kernel options: `key` names the shapes and the
    mask function (what the compiled kernels are cached by), `what` them for the log; the first
    call of a key in auto mode measures every configuration first (_measure)."""
    want = mode()
    if want != "auto":
        return call(CONFIGS[want])
    name = _PICKED.get(key)
    if name is None:
        if torch.cuda.is_current_stream_capturing():
            switches.once(log, "capture", logging.INFO, "commopt flex: backward tiles not yet measured for a call "
                          "inside a CUDA-graph capture; the default tiles run there (run a call outside first)")
            return call(CONFIGS["default"])
        name = _PICKED[key] = _measure(what, call)
    return call(CONFIGS[name])


def picked() -> dict[tuple, str]:
    """The configurations picked so far, by key (for reports and tests)."""
    return dict(_PICKED)


def _measure(what: str, call: Callable[[dict], object]) -> str:
    """The name of the configuration whose calls ran fastest (the median of REPS); one that raises
    is logged and left out, the default never (its error is the call's own)."""
    times = {}
    for name, options in CONFIGS.items():
        try:
            times[name] = _time_ms(call, options)
        except Exception as e:  # noqa: BLE001  (a candidate's compile or launch failure: left out, logged)
            if name == "default":
                raise
            log.warning("commopt flex: backward tiles %r failed for %s (%s: %s); left out", name, what,
                        type(e).__name__, e)
    best = min(times, key=times.get)
    log.info("commopt flex: backward tiles %r for %s (ms: %s)", best, what,
             ", ".join(f"{n} {t:.3f}" for n, t in times.items()))
    return best


def _time_ms(call: Callable[[dict], object], options: dict) -> float:
    """Device ms of call(options): one call to compile and warm, then the median of REPS."""
    call(options)
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(options)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)
