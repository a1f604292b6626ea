"""GPU tests run on the device machine (`make test-gpu`); each skips without 2 GPUs.
CUDA is queried inside the tests, never at import."""

from __future__ import annotations

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "kernels")]


@pytest.fixture
def two_gpus():
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    return 2
