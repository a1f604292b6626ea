"""Tests that need an optional package: skip where it is missing, fail under CI (where the test
extras install it, so a skip would hide a broken install)."""

from __future__ import annotations

from torch_commopt.core import env

TORCHTITAN_VERSION = "0.2.2"  # what the recipe targets (integrations/torchtitan)


def torchtitan_or_skip() -> None:
    """At a test module's top: skip the module unless torchtitan TORCHTITAN_VERSION is importable;
    under CI ($CI set), fail instead."""
    import pytest

    try:
        import torchtitan
        missing = (None if torchtitan.__version__ == TORCHTITAN_VERSION
                   else f"needs torchtitan {TORCHTITAN_VERSION}, found {torchtitan.__version__}")
    except ImportError as e:
        missing = f"torchtitan is not importable ({e}); `pip install -e .[test]` installs {TORCHTITAN_VERSION}"
    if missing and env.under_ci():
        pytest.fail(missing, pytrace=False)
    if missing:
        pytest.skip(missing, allow_module_level=True)


def _histc_integers_on_cpu(histc):
    """torch.histc, with integer CPU input counted by bincount (the same counts): CPU histc takes no
    integers, and torchtitan's MoE router counts its int64 expert indices with it."""
    import torch

    def histc_cpu(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's names
        if not input.is_floating_point() and input.device.type == "cpu":
            return torch.bincount(input.reshape(-1), minlength=bins).to(input.dtype)
        return histc(input, bins=bins, min=min, max=max, out=out)

    histc_cpu.commopt_shim = True
    return histc_cpu


def torchtitan_moe_cpu_shims() -> None:
    """What torchtitan 0.2.2's MoE models need to run on CPU (tests and bench_moe's smoke run, not
    the recipe): integer histc through bincount, and its EP dispatch's permutation built by its own
    CPU fallback (use_cpu=True) instead of a Triton kernel.  Idempotent."""
    import functools

    import torch
    from torchtitan.models.moe import kernels, utils

    if not getattr(torch.histc, "commopt_shim", False):
        torch.histc = _histc_integers_on_cpu(torch.histc)
    utils.generate_permute_indices = functools.partial(kernels.generate_permute_indices, use_cpu=True)
