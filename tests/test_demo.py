"""The main job exits 0 and shows what it found, the schedules and the numerics."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_and_reports():
    proc = subprocess.run([sys.executable, "-m", "torch_commopt", "demo", "--backend", "gloo"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "ag_matmul" in out and "matmul_rs" in out and "chunked:4" in out
    assert "(forward" in out and "(backward" in out
    assert "all outputs and gradients within tolerance" in out


def test_demo_rejects_bad_options_before_spawning():
    proc = subprocess.run([sys.executable, "-m", "torch_commopt", "demo", "--chunks", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "chunks" in proc.stderr
