"""The MoE flavors of the torchtitan recipe: torchtitan's own parallelize function, then the token
exchange of every expert-parallel MoE layer swapped for commopt's (`Config.moe_schedule`).

Train specs "deepseek_v3_commopt" and "qwen3_commopt": the model's own spec with
`parallelize_fn = moe_parallelize(<its parallelize function>)`.  Everything torchtitan does
(expert parallelism with its mesh, TP, FSDP of the experts, activation checkpointing, its own
compile of the layers' children except the experts when `[compile]` asks for it) is unchanged;
afterwards each `moe.experts` that torchtitan's ExpertParallel hooked exchanges its tokens with
commopt's schedule on the same EP group (kernels/moe/module.swap_expert_parallel).  With
`commopt.enable = false` the stock function runs alone.  Experts under ExpertTensorParallel
(EP with ETP > 1, a 2-D mesh) are left to torchtitan, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from torch_commopt.integrations.torchtitan.config import commopt_section
from torch_commopt.kernels.moe.module import swap_expert_parallel
from torch_commopt.tuner.moe.choose import moe_chooser

log = logging.getLogger(__name__)

# train spec name -> (torchtitan model package, its parallelize function's module and name)
MOE_SPECS = {
    "deepseek_v3_commopt": ("torchtitan.models.deepseek_v3", "torchtitan.models.deepseek_v3.infra.parallelize",
                            "parallelize_deepseekv3"),
    "qwen3_commopt": ("torchtitan.models.qwen3", "torchtitan.models.qwen3.infra.parallelize", "parallelize_qwen3"),
}


def moe_parallelize(base: Callable) -> Callable:
    """`base` (torchtitan's parallelize function of a MoE model), then commopt's token exchange in
    every expert-parallel MoE layer when the job's [commopt] section enables it."""

    def parallelize(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
        model = base(model, parallel_dims, job_config)
        section = commopt_section(job_config)
        if not section.enable:
            return model
        cfg = section.to_config()
        schedule = cfg.moe_schedule
        swapped = swap_expert_parallel(model, schedule, moe_chooser(cfg))
        log.info("commopt: %d MoE layers exchange their tokens with %s%s", len(swapped), schedule,
                 "" if swapped or not parallel_dims.ep_enabled else " (none found: is expert parallelism on?)")
        return model

    parallelize.commopt_base = base  # what it wraps (register() recognizes its own spec by it)
    return parallelize


def moe_train_spec(name: str) -> Any:
    """The torchtitan TrainSpec of MOE_SPECS[name]: the model's own, its parallelize_fn wrapped."""
    import dataclasses
    import importlib

    package, module, function = MOE_SPECS[name]
    spec = importlib.import_module(package).get_train_spec()
    base = getattr(importlib.import_module(module), function)
    return dataclasses.replace(spec, parallelize_fn=moe_parallelize(base))
