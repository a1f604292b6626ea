"""GPU tests run on the device machine (`make test-gpu`); each skips without the GPUs it needs
(`two_gpus`: 2; `one_gpu`: 1; `two_ranks` / `four_ranks` / `more_ranks`: 2 / 4 / 3 and 4, or one GPU shared by that many
ranks over gloo when TORCH_COMMOPT_SHARED_DEVICE=1 -- kernels/gpu/shared_device.py: correctness only).
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


def _ranks(world: int) -> tuple[int, str]:
    """(world, process-group backend): `world` GPUs with NCCL, or with TORCH_COMMOPT_SHARED_DEVICE=1
    `world` ranks on one GPU with gloo (the symmetric buffers mapped by CUDA IPC)."""
    import torch

    from torch_commopt.kernels.gpu import shared_device

    if torch.cuda.is_available() and torch.cuda.device_count() >= world and not shared_device.enabled():
        return world, "nccl"
    if torch.cuda.is_available() and shared_device.enabled():
        return world, "gloo"
    pytest.skip(f"needs {world} CUDA GPUs, or one with {shared_device.ENV}=1")


@pytest.fixture
def two_ranks():
    return _ranks(2)


@pytest.fixture
def four_ranks():
    """A 2 x 2 mesh's four ranks."""
    return _ranks(4)


@pytest.fixture(params=[3, 4], ids=lambda w: f"world{w}")
def more_ranks(request):
    """Three and four ranks: an odd world (rings of two steps, rows that split in 3) and four peers."""
    return _ranks(request.param)
