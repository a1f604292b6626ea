"""The main job exits 0 and shows what it found, the schedules and the numerics.  The job runs
through the command line's own entry (cli.main, what `python -m torch_commopt` calls) in this
process, so that its ranks fork from the suite's warm fork server instead of a fresh
interpreter's; the refusal of a bad option runs `python -m torch_commopt` itself."""

from __future__ import annotations

import subprocess
import sys

from torch_commopt.cli import main


def test_demo_runs_and_reports(capsys):
    assert main(["demo", "--backend", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "ag_matmul" in out and "matmul_rs" in out and "chunked:4" in out
    assert "(forward" in out and "(backward" in out
    assert "all outputs and gradients within tolerance" in out


def test_demo_rejects_bad_options_before_spawning():
    proc = subprocess.run([sys.executable, "-m", "torch_commopt", "demo", "--chunks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "chunks" in proc.stderr
