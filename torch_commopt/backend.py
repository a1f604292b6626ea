"""The `commopt` torch.compile backend: Inductor with the commopt post-grad pass.

Registered under the name "commopt" through the `torch_dynamo_backends` entry point (so
`torch.compile(backend="commopt")` works without importing the package) and on
`import torch_commopt` (for source checkouts that are not installed).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torch_commopt.config import Config

log = logging.getLogger("torch_commopt.backend")

BACKEND_NAME = "commopt"


def inductor_patches(config: Config, mode: str | None = None) -> dict[str, Any]:
    """The Inductor config patches one compile runs under."""
    from torch_commopt.passes.pipeline import CommoptPass

    patches: dict[str, Any] = {}
    if mode is not None:
        patches.update(torch._inductor.list_mode_options(mode))
    if config.cuda_graphs:  # replayed from CUDA graphs: let Inductor capture them (CUDA graphs only)
        patches["triton.cudagraphs"] = True
    patches.update(config.extra_inductor_options)
    if torch._inductor.config.post_grad_custom_post_pass is not None:
        log.warning("commopt replaces the post_grad_custom_post_pass already set in Inductor's config")
    patches["post_grad_custom_post_pass"] = CommoptPass(config)
    if config.regather_for_backward or config.saved_gather_budget_mib is not None or "attention" in config.patterns:
        from torch_commopt.passes.joint import JointPass

        if torch._inductor.config.joint_custom_post_pass is None:
            patches["joint_custom_post_pass"] = JointPass(config)
        else:  # the user's own joint pass stays; what commopt does on the joint graph is off
            log.warning("commopt keeps the joint_custom_post_pass set in Inductor's config: context-parallel "
                        "attention in training and the regather options are off for this compile")
    patches["fx_graph_cache"] = config.fx_graph_cache
    return patches


def commopt_backend(gm: torch.fx.GraphModule, example_inputs, *, options: Any = None, mode: str | None = None, **kwargs):
    """torch.compile backend: `options` is a dict of Config fields or a Config."""
    if kwargs:
        raise ValueError(f"commopt backend: unexpected argument(s) {sorted(kwargs)}")
    config = options if isinstance(options, Config) else Config.from_options(options)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_patches(config, mode))


def register() -> None:
    """Register the backend by name unless already registered (or about to be, by its entry point)."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME in registry._COMPILER_FNS:
        return
    registry._discover_entrypoint_backends()
    if registry._BACKENDS.get(BACKEND_NAME) is not None:
        # The entry point is installed: lookup_backend will load and register it; registering
        # here too would make that registration fail as a duplicate.
        return
    registry.register_backend(commopt_backend, name=BACKEND_NAME)
