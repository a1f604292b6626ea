"""Probe (timing only): how much do one machine's schedule probes move from pass to pass?

The tuner's per-schedule factors come from one pass of the schedule probes (calibrate.measure).
Over the 2x H100 eager sweeps since session 42 they moved 2-3% between machines, the size of
the gaps between the leading candidates, and replaying every stored sweep with each run's
factors replaced by the geometric mean of the other runs' (leave one out) lifted the top-1
count from 63 to 69 of 84 (eager with per-call graphs) and from 66 to 68 of 70 (replayed):
one pass's factors carry noise the sweep does not share.  Whether more passes on one machine
remove it (in-machine noise) or not (a machine's own offsets that do not carry across shapes)
is what this measures: one calibration, then PASSES more passes of the three probe sets the
factors come from (eager long probes, replayed long probes, replayed short probes), read by
median (as calibrate) and round-paired in alternation; with --settle S, each pass starts
after S seconds of GEMMs (calibrate._settle) or S seconds idle, in alternation too.  Every
pass's raw seconds are stored, so the factors can be re-derived offline against any
calibration (costmodel_replay).

Measured (session 46, benchmarks/NOTES.md): the eager long probes move as much pass to pass on
one machine as between machines (RS ce_push:1 +-4%), and sweeps replayed with factors from one
pass or from medians of 2-6 passes hit the same top-1 counts: more passes would not help.
--cold and --after-phases found no calibration phase that slows the probes after it.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
      python3 benchmarks/probe_factor_spread.py OUTDIR [--passes 6] [--settle S] [--cold]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from torch_commopt.launch import run_distributed  # noqa: E402


def worker(rank: int, world: int, args) -> dict:
    from gpu_clocks import snapshot as gpu_state
    from torch_commopt.tuner import calibrate

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    name = dist.group.WORLD.group_name

    def one_pass(settled: bool, paired: bool, when: str) -> dict:
        calibrate.PROBES_PAIRED = paired
        if settled:
            calibrate._settle(device, args.settle)
        else:
            torch.cuda.synchronize(device)
            time.sleep(args.settle)
        before = gpu_state(rank)
        start = time.perf_counter()
        eager = calibrate._schedule_probes(name, world, device)
        replayed = calibrate._schedule_probes(name, world, device, graphs=True)
        short = calibrate._schedule_probes(name, world, device, calibrate.SHORT_PROBE_SHAPES, graphs=True)
        return {"when": when, "paired": paired, "settled": settled, "gpu_state_before": before,
                "seconds": time.perf_counter() - start, "eager": eager, "replayed": replayed, "short": short,
                "gpu_state": gpu_state(rank)}

    if args.after_phases:  # a pass after each of the calibration's phases, one at a time
        group, dt, out = dist.group.WORLD, torch.bfloat16, {"passes": [one_pass(False, False, "first")]}
        phases = {"gemm": lambda: calibrate._gemm_samples(device, dt, 5),
                  "collectives": lambda: calibrate._collective_times_checked(group, world, device, 5),
                  "host": lambda: calibrate._host_costs(name, world, device, dt),
                  "copy-engine probes": lambda: calibrate._gpu_probes(name, world, device, 5),
                  "attention": lambda: calibrate._attention_times(device, dt, 5)}
        for phase, fn in phases.items():
            fn()
            out["passes"].append(one_pass(False, False, f"after {phase}"))
        out["passes"].append(one_pass(False, False, "again"))
        return out
    # --cold: two passes before the calibration (the first is the process's first use of every
    # schedule), so the calibration's own probes are not the first
    early = [one_pass(False, False, f"before calibration {i}") for i in range(2 if args.cold else 0)]
    t0 = time.perf_counter()
    cal = calibrate.measure(name, device, ("bfloat16",))
    out = {"calibration": json.loads(cal.to_json()), "calibration_s": time.perf_counter() - t0,
           "calibration_phases_s": dict(calibrate.LAST_PHASES), "passes": early}
    for i in range(args.passes):
        paired = i % 2 == 1 if not args.settle else i % 4 >= 2
        out["passes"].append(one_pass(bool(args.settle) and i % 2 == 1, paired, "after calibration"))
    calibrate.PROBES_PAIRED = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--settle", type=float, default=0.0)
    ap.add_argument("--cold", action="store_true", help="two passes before the calibration")
    ap.add_argument("--after-phases", action="store_true",
                    help="no calibration: a pass after each of its phases (run alone), to find one that slows the next")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run_distributed(worker, 2, args, backend="nccl", timeout_s=500)[0]
    keys = ("ag_matmul ce_push:1", "ag_matmul ce_push:1:par=1", "ag_matmul ce_push:4", "matmul_rs ce_push:1",
            "matmul_rs ce_push:2", "matmul_rs ce_pull:2")
    for p in res["passes"]:
        print(f"{p['when']:20s} paired={int(p['paired'])} settled={int(p['settled'])} {p['seconds']:5.1f} s  "
              + "  ".join(f"{k.split()[1]} {p['eager'][k] * 1e3:.3f}" for k in keys if k in p["eager"]))
    res.update(device=torch.cuda.get_device_name(0), torch=torch.__version__, commit=args.commit,
               command=" ".join(["python3", *sys.argv]))
    (out / "probe_factor_spread.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
