"""llama3's parallelize function with each TransformerBlock compiled by commopt.

`parallelize_llama_commopt(model, parallel_dims, job_config)` runs torchtitan's own
`parallelize_llama` (tensor/sequence parallelism, context parallelism, activation
checkpointing, FSDP/HSDP or DDP: all unchanged) with torchtitan's compile of the model turned
off, then compiles each block of `model.layers` in place, and the output projection where TP shards it
without FSDP (`compile_output`):

    torch_commopt.optimize(block, config=<the [commopt] options>, fullgraph=True, dynamic=False)

which is `block.compile(backend="commopt", ...)`.  The compile is lazy, so its trace sees the
block as it is called: parallelized, wrapped by activation checkpointing, with FSDP's hooks
(dynamo skips `nn.Module._call_impl` and FSDP2's dynamo-disabled hooks and starts at the
block's own forward, which is compiled whole).  Module names and state-dict keys stay
torchtitan's (no `_orig_mod.`), and `torch_commopt.optimize.is_optimized(block)` holds.

With `commopt.enable = false` the stock function runs untouched.  Only the model's compile is
replaced: `compile.enable` with "loss" in `compile.components` still compiles the loss with
`compile.backend` (the trainer builds it from the unchanged job config).  Refused together
with commopt, each with a ValueError: async TP (`parallelism.enable_async_tensor_parallel`,
Inductor's micro-pipeline pass over the same collective-matmul pairs, which torchtitan only
enables with its own compile) and `activation_checkpoint.mode = "memory_budget"` (torchtitan
requires its own model compile for it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from torch_commopt.config import Config
from torch_commopt.integrations.torchtitan.config import commopt_section
from torch_commopt.optimize import optimize

log = logging.getLogger(__name__)


def compile_blocks(model: nn.Module, config: Config) -> int:
    """torch_commopt.optimize(block, config=config, fullgraph=True, dynamic=False) for each
    child of `model.layers` (in place); returns how many were compiled."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module):
        raise ValueError(f"commopt: expected a torchtitan model with a `layers` container, got {type(model).__name__}")
    blocks = list(layers.children())
    for block in blocks:
        optimize(block, config=config, fullgraph=True, dynamic=False)
    return len(blocks)


def compile_output(model: nn.Module, config: Config, parallel_dims: Any) -> bool:
    """torch_commopt.optimize(model.output, ...) where tensor parallelism shards it and FSDP does
    not manage it: ColwiseParallel's hooks on the output projection itself all-gather its
    sequence-sharded input, which optimize compiles into the projection's graph (an ag_matmul
    region, and matmul_rs in its backward) instead of leaving NCCL exposed outside every block.
    Returns whether it was compiled."""
    output = getattr(model, "output", None)
    if not isinstance(output, nn.Module) or not parallel_dims.tp_enabled or parallel_dims.fsdp_enabled:
        return False
    optimize(output, config=config, fullgraph=True, dynamic=False)
    return True


def fp32_tp_warning(parallel_dims: Any, job_config: Any) -> str | None:
    """Why this job would train in float32 without meaning to, or None.  torchtitan 0.2.2 applies
    `training.mixed_precision_param` through fully_shard (FSDP or CP on) or torch.autocast
    (DDP or one device) but not to tensor or pipeline parallelism without FSDP
    (distributed/utils.py maybe_enable_amp; pytorch/torchtitan#630): such a job runs its
    matmuls and attention in float32 unless `training.dtype` is bfloat16.  On an H200 pair that makes
    the 8B_4layers TP=2 step ~870 ms against 159 ms at TP=1 (bf16 by autocast) and its peak
    memory higher (fp32 attention takes the math path)."""
    if parallel_dims.fsdp_enabled or not (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        return None
    training = job_config.training
    if training.dtype != "float32" or training.mixed_precision_param == "float32":
        return None
    return ("torchtitan applies no mixed precision to tensor/pipeline parallelism without FSDP "
            "(maybe_enable_amp; pytorch/torchtitan#630): this job trains in float32 (full-precision matmuls: "
            "torchtitan turns on no TF32; attention on the math path: flash and cuDNN take no float32).  Set "
            "training.dtype = \"bfloat16\" (the recipe's toml does) or shard with FSDP")


def parallelize_llama_commopt(model: nn.Module, parallel_dims: Any, job_config: Any) -> nn.Module:
    """torchtitan's parallelize_llama, then each TransformerBlock compiled by commopt when
    `job_config.commopt.enable` (the TrainSpec's parallelize_fn of "llama3_commopt").  Warns
    (fp32_tp_warning) where the job would train in float32 without asking to."""
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    warning = fp32_tp_warning(parallel_dims, job_config)
    if warning:
        log.warning("commopt recipe: %s", warning)
    section = commopt_section(job_config)
    if not section.enable:
        return parallelize_llama(model, parallel_dims, job_config)
    config = section.to_config()
    if job_config.parallelism.enable_async_tensor_parallel:
        raise ValueError("commopt.enable and parallelism.enable_async_tensor_parallel both rewrite the TP "
                         "collective-matmul pairs: turn one of them off")
    if job_config.activation_checkpoint.mode == "memory_budget":
        raise ValueError("activation_checkpoint.mode = 'memory_budget' needs torchtitan's own model compile; "
                         "with commopt.enable use 'selective', 'full' or 'none'")
    components = list(job_config.compile.components)
    if job_config.compile.enable and "model" in components:
        log.info("commopt compiles the TransformerBlocks; compile.backend=%r is not used for the model",
                 job_config.compile.backend)
    # The trainer keeps the original job_config: its loss compile is unaffected.
    no_model_compile = dataclasses.replace(
        job_config, compile=dataclasses.replace(job_config.compile, components=[c for c in components if c != "model"]))
    model = parallelize_llama(model, parallel_dims, no_model_compile)
    n = compile_blocks(model, config)
    head = compile_output(model, config, parallel_dims)
    log.info("commopt: compiling %d TransformerBlocks%s with %s", n, " and the output projection" if head else "",
             config)
    return model
