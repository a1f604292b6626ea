"""SM clock, power and throttle reasons of the GPUs while a benchmark times something.

`ClockSampler` runs `nvidia-smi --query-gpu=... -lms PERIOD` beside the timed work and
summarizes each GPU's samples: mean / lowest / highest SM clock, mean power, and the share of
samples with the software power cap active (throttle reason 0x4).  On 2x H200 the SM clock
fell from ~1.9 GHz to 1.44-1.56 GHz under sustained load with that reason set (bench_costmodel's
snapshots, session 25), which slows every kernel of a denser program: the figure that tells
"the overlap made the step denser, the clocks dropped" from "a kernel got slower".

    with ClockSampler(enabled=rank == 0) as clocks:
        ... timed work ...
    clocks.summary()  # {gpu index: {...}}; {} where disabled or nvidia-smi is missing

`snapshot(index)` reads one GPU once (bench_costmodel's before / after figures).  The sampler
also reads each GPU's energy counter (NVML's total energy since the driver loaded, mJ) at its
start and end, and the enforced power limit: on a GPU held at its power cap the time of a step
is its energy over the cap, so a variant is faster only as far as it takes less energy a step.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess

FIELDS = ("index", "clocks.sm", "power.draw", "clocks_throttle_reasons.active")
SW_POWER_CAP = 0x4


def snapshot(index: int) -> dict | None:
    """GPU `index`'s SM clock (MHz), power (W), temperature (C) and active throttle reasons now,
    or None where nvidia-smi cannot be read."""
    fields = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
    try:
        row = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "-i", str(index)], capture_output=True, text=True, timeout=5, check=True).stdout
        sm, power, temp, reasons = [x.strip() for x in row.strip().split(",")]
        return {"sm_mhz": float(sm), "power_w": float(power), "temp_c": float(temp), "throttle": reasons}
    except Exception:  # noqa: BLE001 - a figure for the report only
        return None


class _Nvml:
    """NVML through ctypes (no pynvml on the device machine): energy counters and power limits.
    Every call returns None where NVML cannot be loaded or read (CPU machines)."""

    def __init__(self):
        self.lib = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() == 0:
                self.lib = lib
        except OSError:
            pass

    def _handle(self, index: int):
        h = ctypes.c_void_p()
        return h if self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(h)) == 0 else None

    def count(self) -> int:
        n = ctypes.c_uint()
        return n.value if self.lib is not None and self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0 else 0

    def energy_mj(self, index: int) -> int | None:
        """Total energy GPU `index` used since the driver loaded, mJ."""
        h = self._handle(index) if self.lib is not None else None
        e = ctypes.c_ulonglong()
        return e.value if h is not None and self.lib.nvmlDeviceGetTotalEnergyConsumption(h, ctypes.byref(e)) == 0 else None

    def power_limit_w(self, index: int) -> float | None:
        """The enforced power limit of GPU `index`, W."""
        h = self._handle(index) if self.lib is not None else None
        mw = ctypes.c_uint()
        return mw.value / 1e3 if h is not None and self.lib.nvmlDeviceGetEnforcedPowerLimit(h, ctypes.byref(mw)) == 0 else None


def energy_now() -> dict[int, int]:
    """{GPU index: total energy since the driver loaded, mJ}; {} where NVML is missing."""
    nvml = _Nvml()
    return {i: e for i in range(nvml.count()) if (e := nvml.energy_mj(i)) is not None}


class ClockSampler:
    """enabled=False: samples nothing, summary() is {} (CPU runs, ranks other than the reader)."""

    def __init__(self, period_ms: int = 100, enabled: bool = True):
        self.period_ms, self.enabled, self.proc, self.out = period_ms, enabled, None, ""
        self.energy0: dict[int, int] = {}
        self.energy_j: dict[int, float] = {}
        self.limits: dict[int, float] = {}

    def __enter__(self) -> "ClockSampler":
        if not self.enabled:
            return self
        nvml = _Nvml()
        self.limits = {i: w for i in range(nvml.count()) if (w := nvml.power_limit_w(i)) is not None}
        self.energy0 = energy_now()
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                                          f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        except OSError:  # no nvidia-smi: no figures
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        end = energy_now() if self.energy0 else {}
        self.energy_j = {i: (end[i] - self.energy0[i]) / 1e3 for i in end if i in self.energy0}
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, _ = self.proc.communicate()

    def summary(self) -> dict[int, dict]:
        """{GPU index: figures}: the nvidia-smi samples' and, where NVML answered, `energy_j`
        (used over the sampler's span) and `power_limit_w`."""
        samples: dict[int, list[tuple[float, float, int]]] = {}
        for line in self.out.splitlines():
            try:
                idx, sm, power, reasons = [x.strip() for x in line.split(",")]
                samples.setdefault(int(idx), []).append((float(sm), float(power), int(reasons, 16)))
            except ValueError:  # a header, a cut line, "[N/A]"
                continue
        return {idx: {"samples": len(s), "sm_mhz_mean": round(statistics.mean(x[0] for x in s), 1),
                      "sm_mhz_min": min(x[0] for x in s), "sm_mhz_max": max(x[0] for x in s),
                      "power_w_mean": round(statistics.mean(x[1] for x in s), 1),
                      "power_capped_share": round(sum(1 for x in s if x[2] & SW_POWER_CAP) / len(s), 3),
                      **({"energy_j": round(self.energy_j[idx], 3)} if idx in self.energy_j else {}),
                      **({"power_limit_w": self.limits[idx]} if idx in self.limits else {})}
                for idx, s in sorted(samples.items()) if s}
