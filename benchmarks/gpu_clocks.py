"""SM clock, power and throttle reasons of the GPUs while a benchmark times something.

`ClockSampler` runs `nvidia-smi --query-gpu=... -lms PERIOD` beside the timed work and
summarizes each GPU's samples: mean / lowest / highest SM clock, mean power, and the share of
samples with the software power cap active (throttle reason 0x4).  On 2x H200 the SM clock
fell from ~1.9 GHz to 1.44-1.56 GHz under sustained load with that reason set (bench_costmodel's
snapshots), which slows every kernel of a denser program: the figure that tells
"the overlap made the step denser, the clocks dropped" from "a kernel got slower".

    with ClockSampler(enabled=rank == 0) as clocks:
        ... timed work ...
    clocks.summary()  # {gpu index: {...}}; {} where disabled or nvidia-smi is missing
    clocks.summary({"a": [(t0, t1), ...], ...})  # {label: {gpu index: {...}}}: the samples taken
                                                 # inside each label's time.time() windows

`snapshot(index)` reads one GPU once (bench_costmodel's before / after figures).
"""

from __future__ import annotations

import datetime
import statistics
import subprocess

FIELDS = ("timestamp", "index", "clocks.sm", "power.draw", "clocks_throttle_reasons.active")
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


class ClockSampler:
    """enabled=False: samples nothing, summary() is {} (CPU runs, ranks other than the reader)."""

    def __init__(self, period_ms: int = 100, enabled: bool = True):
        self.period_ms, self.enabled, self.proc, self.out = period_ms, enabled, None, ""

    def __enter__(self) -> "ClockSampler":
        if not self.enabled:
            return self
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(FIELDS)}",
                                          "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi: no figures
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, _ = self.proc.communicate()

    def samples(self) -> list[tuple[float, int, float, float, int]]:
        """(epoch seconds, GPU index, SM MHz, W, throttle reasons) of every sample read."""
        out = []
        for line in self.out.splitlines():
            try:
                stamp, idx, sm, power, reasons = [x.strip() for x in line.split(",")]
                # local time, as time.time()
                when = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                out.append((when, int(idx), float(sm), float(power), int(reasons, 16)))
            except ValueError:  # a header, a cut line, "[N/A]"
                continue
        return out

    def summary(self, windows: dict[str, list[tuple[float, float]]] | None = None) -> dict:
        """{GPU index: figures} over every sample; with `windows` ({label: [(start, end), ...]} in
        time.time() seconds), {label: {GPU index: figures}} over the samples inside its windows
        (variants timed in turns: each one's own clocks)."""
        rows = self.samples()
        if windows is None:
            return _figures(rows)
        return {label: _figures([r for r in rows if any(a <= r[0] <= b for a, b in spans)])
                for label, spans in windows.items()}


def _figures(rows: list[tuple[float, int, float, float, int]]) -> dict[int, dict]:
    per_gpu: dict[int, list[tuple[float, float, int]]] = {}
    for _, idx, sm, power, reasons in rows:
        per_gpu.setdefault(idx, []).append((sm, power, reasons))
    return {idx: {"samples": len(s), "sm_mhz_mean": round(statistics.mean(x[0] for x in s), 1),
                  "sm_mhz_min": min(x[0] for x in s), "sm_mhz_max": max(x[0] for x in s),
                  "power_w_mean": round(statistics.mean(x[1] for x in s), 1),
                  "power_capped_share": round(sum(1 for x in s if x[2] & SW_POWER_CAP) / len(s), 3)}
            for idx, s in sorted(per_gpu.items()) if s}
