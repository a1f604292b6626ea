"""No fixed name under the shared temporary directory in the sources, scripts, job files or
docs: another user's (or an attacker's) file of that name would be read, or written through,
in place of ours.  Temporary files and directories come from tempfile / mktemp / tmp_path."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXED = re.compile("/" + r"(tmp|var/tmp|dev/shm)/[\w.{$-]")  # a name under one of them, not the directory alone
SCANNED = ["torch_commopt", "tests", "benchmarks", "docs", "integrations", "README.md", "Makefile", ".ci"]
SUFFIXES = {".py", ".sh", ".toml", ".md", ".cfg", ".ini", ".txt", ""}


def _files():
    for top in SCANNED:
        path = ROOT / top
        candidates = [path] if path.is_file() else path.rglob("*") if path.is_dir() else []
        for f in candidates:
            if f.is_file() and f.suffix in SUFFIXES and "results" not in f.relative_to(ROOT).parts:
                yield f


def test_no_fixed_shared_temporary_paths():
    hits = []
    for f in _files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{f.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                 if FIXED.search(line)]
    assert not hits, "fixed temporary paths:\n" + "\n".join(hits)
    assert sum(1 for _ in _files()) > 50  # the scan saw the tree
