"""GPU tests run on the device machine (`make test-gpu`); each skips without the GPUs it needs
(`two_gpus`: 2; `one_gpu`: 1).
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


@pytest.fixture
def one_gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda", 0)
