"""The GEMMs a region's candidates run, timed at their own shapes before the model ranks them.

The GEMM fit (calibrate.fit_gemm) is a roofline over five samples; cuBLAS's speed moves
with each shape's tiling in ways it cannot follow, and a piece of a split GEMM is where
that shows.  On an H100 the reduce-scatter probe shape's four quarter GEMMs (K 3072,
N 6144) take 645 us against 621 for its two halves and 608 for the whole GEMM, while at
16384 x 8192 x 8192 they take 1428 against 1453 and 1457.  Priced by the fit alone, the
schedule factors (measured / predicted on the probe shapes) absorb the probe's penalty and
charge it to every four-piece schedule.  So the calibration times the probes' own GEMMs
(calibrate.measure), a region's ranking times its candidates' GEMMs (a few ms each, once
per shape: cached), and the model prices those at what they measured
(Calibration.gemm_table; docs/tuner.md).

Rank 0 of the group times and publishes (tuner.decide): every rank ranks with the same
figures.  On a CPU, inside a CUDA-graph capture, or where timing fails, the fit stays (logged).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from torch_commopt.core.schedule import Schedule
from torch_commopt.tuner.cache import TunerCache
from torch_commopt.tuner.calibration import Calibration
from torch_commopt.tuner.decide import decide
from torch_commopt.tuner.matmul.model import RegionShape, gemm_keys

log = logging.getLogger("torch_commopt.tuner.gemm_table")

TIMED_DTYPES = ("bfloat16", "float16", "float32")  # what torch.mm multiplies (float8: the fit's rate)
REPS = 3


def timeable(keys: list[str], cal: Calibration) -> list[str]:
    """The keys worth timing: not in the table yet, of a dtype torch.mm multiplies."""
    return [k for k in keys if k not in cal.gemm_table and k.split(" ")[0] in TIMED_DTYPES]


def time_gemms(keys: list[str], device: torch.device, reps: int = REPS) -> dict[str, float]:
    """{key: seconds} of each GEMM alone (timing.device_time: back-to-back device time at the
    clocks of a busy GPU), outside any fake-tensor mode the compiler may be tracing in."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from torch_commopt.tuner.timing import device_time

    out = {}
    with unset_fake_temporarily(), torch.no_grad():
        for key in keys:
            dtype, m, n, k = key.split(" ")
            a = torch.randn(int(m), int(k), device=device, dtype=getattr(torch, dtype))
            b = torch.randn(int(k), int(n), device=device, dtype=getattr(torch, dtype))
            out[key] = device_time(lambda a=a, b=b: torch.mm(a, b), device, reps, preroll=True)
    return out


def with_gemms(cal: Calibration, shape: RegionShape, schedules: list[Schedule], device: torch.device,
               group_name: str | None, cache_dir: str | None, timeout_s: float, *,
               graphs: bool | str = False) -> Calibration:
    """`cal` with the GEMMs the model prices to rank `schedules` for `shape` (model.gemm_keys) in
    its table: rank 0's timing, from the tuner cache where it holds them.  Unchanged on a CPU or
    where nothing is left to time."""
    from torch_commopt.tuner.machine import machine_key

    if device.type != "cuda":
        return cal
    keys = timeable(gemm_keys(shape, cal, schedules, graphs=graphs), cal)
    if not keys:
        return cal
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # timing would break the caller's capture: the fit
        log.info("commopt tuner: compiled inside a CUDA-graph capture; %d GEMMs priced by the fit", len(keys))
        return cal
    question = {"question": "gemm_table", **machine_key(cal.device, cal.world), "gemms": keys}

    def answer() -> dict[str, float]:
        cache = TunerCache(cache_dir)
        stored = cache.get(question)
        if isinstance(stored, dict) and set(stored) == set(keys):
            return stored
        try:
            timed = time_gemms(keys, device)
        except Exception as e:  # noqa: BLE001 - a failed timing (memory, a capture) leaves the fit
            log.warning("commopt tuner: timing %d GEMMs failed (%s: %s); the fit prices them", len(keys),
                        type(e).__name__, e)
            return {}
        cache.put(question, timed)
        return timed

    table = decide(group_name, question, answer, timeout_s)
    return dataclasses.replace(cal, gemm_table={**cal.gemm_table, **{k: float(v) for k, v in table.items()}})
