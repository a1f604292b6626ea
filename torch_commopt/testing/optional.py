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
