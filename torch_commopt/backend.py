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


def check_arguments(options: Any, mode: str | None, kwargs: dict[str, Any]) -> Config:
    """The backend's arguments as a checked Config; ValueError naming the bad one."""
    if kwargs:
        raise ValueError(f"commopt backend: unexpected argument(s) {sorted(kwargs)}")
    if mode is not None:
        modes = tuple(torch._inductor.list_mode_options())
        if mode not in modes:
            raise ValueError(f"commopt backend: torch.compile mode={mode!r} is not one of Inductor's modes {modes}")
    return options if isinstance(options, Config) else Config.from_options(options)


class RefusedOptions:
    """What the backend returns in place of a compiled graph when its arguments are bad: every
    call raises ValueError naming the bad option.

    torch.compile hands `options` to the backend only when dynamo compiles the first graph, and
    dynamo wraps whatever the backend raises in BackendCompilerFailed; with
    torch._dynamo.config.suppress_errors on, it logs that as a warning and runs the frame
    eagerly (torch/_dynamo/convert_frame.py, ConvertFrame.__call__), so a bad option raised at
    compile would silently run the program without commopt.  Raised when the graph runs, the
    error reaches the caller whatever dynamo's settings, as a plain ValueError.
    """

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(self.message)

    def __repr__(self) -> str:
        return f"RefusedOptions({self.message!r})"


def commopt_backend(gm: torch.fx.GraphModule, example_inputs, *, options: Any = None, mode: str | None = None, **kwargs):
    """torch.compile backend: `options` is a dict of Config fields or a Config.  Bad arguments
    are checked first and give a compiled graph that raises ValueError naming them at every call
    (RefusedOptions: never hidden by dynamo's suppress_errors)."""
    try:
        config = check_arguments(options, mode, kwargs)
    except ValueError as e:
        log.error("commopt backend: %s; every call of this graph raises it", e)
        return RefusedOptions(str(e))
    from torch._inductor.compile_fx import compile_fx

    config = replayed_by_mode(config, mode)
    return compile_fx(gm, example_inputs, config_patches=inductor_patches(config, mode))


def replayed_by_mode(config: Config, mode: str | None) -> Config:
    """`config` with cuda_graphs on when torch.compile's `mode` makes Inductor replay CUDA graphs
    ("reduce-overhead", "max-autotune"): the schedules are then ranked as replayed (no per-call
    host cost), as they run.  Logged once per compile."""
    if config.cuda_graphs or mode is None or not torch._inductor.list_mode_options(mode).get("triton.cudagraphs"):
        return config
    import dataclasses

    log.info("commopt backend: mode=%r replays CUDA graphs; ranking schedules as replayed (cuda_graphs=True)", mode)
    return dataclasses.replace(config, cuda_graphs=True)


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
