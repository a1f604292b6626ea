"""The `[commopt]` section of a torchtitan 0.2.2 job config, and its validation.

torchtitan merges the `JobConfig` dataclass of the module named by
`job.custom_config_module` into its own (torchtitan/config/manager.py, `_merge_configs`), so
naming this module adds the section to the toml file and the CLI:

    [job]
    custom_config_module = "torch_commopt.integrations.torchtitan.config"

    [commopt]
    enable = true
    schedule = "chunked"                            # any torch_commopt.Config field, flat ...
    options = '{"ar_split": true, "chunks": 2}'     # ... or any of them as a JSON object

    --commopt.enable --commopt.mode model --commopt.options '{"memory_budget_mib": 512}'

The section is checked when it is built (torchtitan builds it from the toml file, then again
from the CLI, both before any process group or model exists): an unknown key or a bad value
raises ValueError naming it.  The keys are torch_commopt.Config's fields: docs/configuration.md.
This module needs neither torchtitan nor tyro.
"""

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from torch_commopt.config import Config
from torch_commopt.optimize import resolve_config

# The Config fields that have a flat field of their own in the section (the common knobs);
# every other Config field goes through `options`.
FLAT_FIELDS = ("schedule", "mode", "chunks")


@dataclass
class Commopt:
    """torch_commopt options for a torchtitan job (the `[commopt]` section)."""

    enable: bool = False
    """Compile each TransformerBlock with the commopt backend (needs model.name =
    "llama3_commopt"; torchtitan's own compile of the model is then not used)."""

    schedule: Optional[str] = None
    """torch_commopt.Config.schedule (docs/configuration.md). Unset: Config's default."""

    mode: Optional[str] = None
    """torch_commopt.Config.mode (docs/configuration.md). Unset: Config's default."""

    chunks: Optional[int] = None
    """torch_commopt.Config.chunks (docs/configuration.md). Unset: Config's default."""

    options: str = ""
    """Further torch_commopt.Config fields (docs/configuration.md) as a JSON object, e.g. '{"ar_split": true}'.
    A key may not also be set by its flat field above."""

    def __post_init__(self) -> None:
        self.to_config()

    def option_dict(self) -> dict[str, Any]:
        """The torch_commopt options this section sets (flat fields and `options` merged)."""
        opts = parse_options(self.options)
        for name in FLAT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if name in opts:
                raise ValueError(f"[commopt]: {name!r} is set both as commopt.{name} and in commopt.options; "
                                 "set it in one place")
            opts[name] = value
        return opts

    def to_config(self) -> Config:
        """The validated torch_commopt.Config; ValueError naming the bad key or value."""
        if not isinstance(self.enable, bool):
            raise ValueError(f"[commopt]: commopt.enable must be true or false, got {self.enable!r}")
        try:
            return resolve_config(None, self.option_dict())
        except (TypeError, ValueError) as e:
            if str(e).startswith("[commopt]"):
                raise
            raise ValueError(f"[commopt]: {e}{self._where(str(e))}") from e

    def _where(self, message: str) -> str:
        """Which key of the section set the field a Config error names ("" if none)."""
        named = re.match(r"Config\.(\w+):", message)
        if named is None:
            return ""
        name = named.group(1)
        return f" (commopt.{name})" if name in FLAT_FIELDS and getattr(self, name) is not None else \
            " (in commopt.options)"


def parse_options(text: Any) -> dict[str, Any]:
    """commopt.options: a JSON object (or, from a toml inline table, a dict) -> a new dict."""
    if isinstance(text, dict):
        return dict(text)
    if not isinstance(text, str):
        raise ValueError(f"[commopt]: commopt.options must be a JSON object string, got {type(text).__name__}")
    if not text.strip():
        return {}
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"[commopt]: commopt.options is not valid JSON ({e}): {text!r}") from e
    if not isinstance(opts, dict):
        raise ValueError(f"[commopt]: commopt.options must be a JSON object, got {text!r}")
    return opts


@dataclass
class JobConfig:
    """torchtitan's JobConfig extension (merged by `job.custom_config_module`): adds `commopt`."""

    commopt: Commopt = field(default_factory=Commopt)


def commopt_section(job_config: Any) -> Commopt:
    """job_config.commopt, or a ValueError saying how to add the section."""
    section = getattr(job_config, "commopt", None)
    if not isinstance(section, Commopt):
        raise ValueError("torchtitan job config has no [commopt] section: set job.custom_config_module = "
                         f"\"{__name__}\" in the toml file (or --job.custom_config_module {__name__})")
    return section


__all__ = ["Commopt", "FLAT_FIELDS", "JobConfig", "commopt_section", "parse_options"]
