"""Importing touches neither CUDA nor a process group; the backend is found by name."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

LEAN = """
import torch, torch.distributed as dist
import torch_commopt
assert not torch.cuda.is_initialized(), "import initialized CUDA"
assert not dist.is_initialized(), "import created a process group"
assert hasattr(torch.ops.commopt, "ag_matmul") and hasattr(torch.ops.commopt, "matmul_rs")
assert "commopt" in torch._dynamo.list_backends(exclude_tags=())
print("lean")
"""

BY_NAME = """
import torch
from torch._dynamo.backends.registry import lookup_backend
fn = lookup_backend("commopt")  # through the torch_dynamo_backends entry point, no import
import torch_commopt  # importing afterwards must not register a duplicate
assert fn is torch_commopt.commopt_backend
assert torch.compile(lambda x: x * 2, backend="commopt")(torch.ones(2)).tolist() == [2.0, 2.0]
print("by-name")
"""


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_is_lean():
    assert "lean" in _run(LEAN)


def test_backend_resolves_by_name_without_import():
    # the entry point is the installed distribution's (make test installs it); a checkout put on
    # PYTHONPATH only, as on the device machine, has none
    if not any(e.name == "commopt" for e in metadata.entry_points(group="torch_dynamo_backends")):
        pytest.skip("torch_commopt is not pip-installed here: no torch_dynamo_backends entry point")
    assert "by-name" in _run(BY_NAME)
