"""tests/gpu/device_run.sh, the one script for the device machine, and the pages that name its modes:
every mode it runs is in its usage line and nothing else is, and every mode docs/benchmarking.md
tells a reader to run is one it has."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "device_run.sh"
DOC = ROOT / "docs" / "benchmarking.md"


def _run_modes() -> set[str]:
    return set(re.findall(r"\$what == (\w+)", SCRIPT.read_text()))


def _usage_modes() -> set[str]:
    usage = next(line for line in SCRIPT.read_text().splitlines() if line.startswith("# Usage:"))
    return set(re.search(r"OUTDIR \[([\w|]+)\]", usage).group(1).split("|"))


def _table(title_row: str) -> list[str]:
    """The rows of the markdown table whose header row starts with title_row."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_row))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _documented_modes() -> set[str]:
    """The modes of the modes table's first column and of the 2-GPU calls' second."""
    names = set()
    for row in _table("| mode | runs |"):
        names |= set(re.findall(r"`(\w+)`", row.split("|")[1]))
    for row in _table("| call | mode and variables |"):
        names |= set(re.findall(r"`(\w+)`", row.split("|")[2]))
    return names


def test_the_usage_line_lists_exactly_the_modes_the_script_runs():
    assert _usage_modes() == _run_modes(), (_usage_modes() ^ _run_modes())


def test_every_mode_the_docs_name_is_one_the_script_runs():
    missing = _documented_modes() - _run_modes()
    assert not missing, f"docs/benchmarking.md names modes device_run.sh does not have: {sorted(missing)}"
