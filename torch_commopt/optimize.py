"""Per-module opt-in: compile only what the user names with backend="commopt".

    model.mlp = torch_commopt.optimize(model.mlp)             # one module (compiled in place)
    step = torch_commopt.optimize(step, mode="model")          # a function

    @torch_commopt.optimize(schedule="sequential")             # a function, decorator form
    def attn(q, k, v): ...

    @torch_commopt.optimize                                    # a Module subclass: every
    class Block(nn.Module): ...                                # instance compiles itself

Everything not named runs as before (eager, or however the caller compiles it).  In a module,
the experts that torchtitan's ExpertParallel parallelized exchange their tokens with
`Config.moe_schedule` (kernels/moe, docs/moe.md).  A module is
compiled in place (its forward traced on the first call, so parallelize it with DTensor before
or after: the trace sees what it is called with).  A module whose own forward hooks redistribute
its input or output (DTensor's ColwiseParallel / RowwiseParallel applied to the module itself,
e.g. a model's output projection) is compiled with those hooks in its graph: `nn.Module.compile`
traces the hooks and the forward as separate frames, so the all-gather in the hook would never
meet the matmul it feeds.  FSDP2's hooks are left out, as `nn.Module.compile` leaves them.  The options are
`torch_commopt.Config`'s fields (docs/configuration.md), checked when `optimize` is called: a bad
one raises there, not inside a training step.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, TypeVar, Union

import torch
from torch import nn

from torch_commopt.config import Config
from torch_commopt.kernels.moe.module import swap_expert_parallel
from torch_commopt.tuner.moe.choose import moe_chooser

T = TypeVar("T")


def resolve_config(config: Optional[Union[Config, dict]], options: dict[str, Any]) -> Config:
    """`config` (a Config, a dict of its fields, or None) with `options` on top, validated."""
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = {f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}
    elif isinstance(config, dict):
        base = dict(config)
    else:
        raise TypeError(f"torch_commopt.optimize: config must be a Config, a dict or None, got {type(config).__name__}")
    return Config.from_options({**base, **options})


def optimize(target: Any = None, *, config: Optional[Union[Config, dict]] = None, dynamic: Optional[bool] = False,
             fullgraph: bool = False, **options: Any) -> Any:
    """Compile `target` with backend="commopt" and Config(config, **options) (the fields:
    docs/configuration.md).

    target: an nn.Module instance (compiled in place and returned), an nn.Module subclass
    (returned with each new instance compiling itself), a function (its compiled version is
    returned), or nothing (a decorator taking one of those).  dynamic, fullgraph: as in
    torch.compile, but dynamic defaults to False: commopt leaves graphs with symbolic sizes
    untouched, and torch.compile's default (None) would recompile with them at the first change
    of an input's shape and keep running that graph.  Raises ValueError for an unknown or
    invalid option, TypeError for a target that is none of these."""
    cfg = resolve_config(config, options)
    if target is None:
        return functools.partial(_apply, cfg=cfg, dynamic=dynamic, fullgraph=fullgraph)
    return _apply(target, cfg=cfg, dynamic=dynamic, fullgraph=fullgraph)


def _apply(target: T, *, cfg: Config, dynamic: Optional[bool], fullgraph: bool) -> T:
    kwargs = {"backend": "commopt", "options": cfg, "dynamic": dynamic, "fullgraph": fullgraph}
    if isinstance(target, nn.Module):
        # expert parallelism is a module's, not a graph's: its exchange is swapped before compiling
        # (its sizes are data; the swapped forward is left uncompiled, as torchtitan leaves its own)
        swap_expert_parallel(target, cfg.moe_schedule, moe_chooser(cfg))
        if _hooks_to_inline(target):
            target._compiled_call_impl = torch.compile(functools.partial(_call_with_hooks, target), **kwargs)  # noqa: SLF001
        else:
            target.compile(**kwargs)
        target._commopt_config = cfg  # noqa: SLF001  (what optimized it, for inspection)
        return target
    if inspect.isclass(target) and issubclass(target, nn.Module):
        return _compiling_class(target, kwargs, cfg)
    if callable(target):
        compiled = torch.compile(target, **kwargs)
        compiled._commopt_config = cfg
        return compiled
    raise TypeError(f"torch_commopt.optimize: expected an nn.Module, a Module subclass or a function, "
                    f"got {type(target).__name__}")


def _hooks_to_inline(module: nn.Module) -> bool:
    """Whether `module` has forward hooks of its own to compile with its forward: any, unless
    FSDP2 manages it (its class renamed FSDP<name>: its hooks are dynamo-disabled and stay eager,
    as nn.Module.compile runs them)."""
    own = module._forward_pre_hooks or module._forward_hooks  # noqa: SLF001
    return bool(own) and not type(module).__name__.startswith("FSDP")


def _call_with_hooks(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's call with its hooks, as `torch.compile(module)` traces it (one frame), without
    wrapping the module (its state-dict keys stay)."""
    return nn.Module._call_impl(module, *args, **kwargs)  # noqa: SLF001


def _compiling_class(cls: type, kwargs: dict, cfg: Config) -> type:
    """cls with an __init__ that compiles each instance once it is built."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kw):
        init(self, *args, **kw)
        if getattr(self, "_commopt_config", None) is None:  # once, also for subclasses
            self.compile(**kwargs)
            self._commopt_config = cfg

    cls.__init__ = __init__
    return cls


def is_optimized(module: nn.Module) -> bool:
    """Whether `module` was compiled by optimize (directly or through its class)."""
    return getattr(module, "_commopt_config", None) is not None and module._compiled_call_impl is not None

