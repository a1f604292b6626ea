"""What every benchmark shares: the result file's name, the machine fields of a report, the
commit, the slowest rank's figure, number formatting and writing the Markdown + JSON pair.

Result files are named `<theme>_<card>x<n>_<date>[_<variant>]` (`card_tag`, `result_stem`);
`benchmarks/results/` keeps one current pair per benchmark and card (benchmarks/README.md).
A variant suffix tells apart reports of one benchmark that measure different things (a shape,
a dtype, a timing mode), never runs of the same thing: a newer run replaces the older pair.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def card_tag(device_name: str, world: int) -> str:
    """'h200x2' for 'NVIDIA H200' at world 2, 'h100x2' for 'NVIDIA H100 80GB HBM3', 'gpux2' for
    a card without an H/A/B/L number, 'cpux2' for 'cpu' or 'CPU (gloo)'."""
    if device_name.lower().startswith("cpu"):
        return f"cpux{world}"
    found = re.search(r"\b([HABL]\d{2,3})\b", device_name)
    return f"{found.group(1).lower() if found else 'gpu'}x{world}"


def today() -> str:
    return datetime.date.today().isoformat()


def result_stem(theme: str, device_name: str, world: int, date: str | None = None, variant: str = "") -> str:
    """`<theme>_<card>x<n>_<date>[_<variant>]`, e.g. ('e2e', 'NVIDIA H200', 2, variant='b1s8192')
    -> 'e2e_h200x2_2026-11-28_b1s8192'."""
    stem = f"{theme}_{card_tag(device_name, world)}_{date or today()}"
    return f"{stem}_{variant}" if variant else stem


def git_commit() -> str:
    """HEAD's short hash, or 'unknown' (a device copy's git metadata can be stale: benchmarks take
    --commit first)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine_meta(device_name: str, world: int, commit: str = "", **extra) -> dict:
    """The fields every report carries: device, world, date, versions, commit, host, command."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": device_name, "world": world, "date": today(), "torch": torch.__version__,
            "triton": triton_version, "commit": commit or git_commit(), "host": platform.node(),
            "command": "python3 " + " ".join(sys.argv), **extra}


def max_over_ranks(values: list[float], device) -> list[float]:
    """Each value's maximum over the process group's ranks (the slowest rank's time, the largest
    error); every rank must call it with as many values."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def fmt(x, digits: int = 3) -> str:
    """A figure for a report's table: '-' for a missing one."""
    return "-" if x is None else f"{x:.{digits}f}"


def write_report(out, stem: str, data, markdown: str) -> tuple[pathlib.Path, pathlib.Path]:
    """`out/<stem>.json` (the raw times and everything derived from them) and `out/<stem>.md`."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(data, indent=1))
    md_path.write_text(markdown)
    return json_path, md_path


def schedule_ran(schedule: str) -> str:
    """What a region's schedule ran: itself, or for a first-call measurement's placeholder
    (`autotune:...`) "measured: <what it decided>"."""
    from torch_commopt.core.schedule import Schedule
    from torch_commopt.tuner.matmul import autotune

    sched = Schedule.parse(schedule)
    if sched.name != "autotune":
        return schedule
    return f"measured: {autotune.decided(sched) or 'not yet'}"


def with_env(fn, values: dict[str, str]):
    """fn(*args) run with the environment variables `values` set, the previous values back after
    (a variant that differs from another only in a switch read at each call)."""
    import os

    def run(*args, **kwargs):
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            return fn(*args, **kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return run
