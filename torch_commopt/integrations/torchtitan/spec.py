"""The torchtitan train specs: "llama3_commopt", llama3's with parallelize_llama_commopt, and the
MoE flavors' (moe.py: "deepseek_v3_commopt", "qwen3_commopt").

Everything else (model class and flavors, pipelining, optimizers, LR schedulers, data
loader, tokenizer, loss, validator, state-dict adapter) is llama3's own spec object's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch_commopt.integrations.torchtitan.parallelize import parallelize_llama_commopt

TRAIN_SPEC_NAME = "llama3_commopt"
log = logging.getLogger(__name__)


# Extra flavors: Llama-3-8B's layer shapes (dim 4096, 32 / 8 heads, SwiGLU hidden 14336) with
# fewer layers, for speed runs on 2 GPUs (docs/torchtitan.md's end-to-end figure) that compile fast;
# 8B_flex_4layers is llama3's 8B_flex (FlexAttention, block-causal over documents) the same way,
# the context-parallel job's model (the debug model's step is all host time).
EXTRA_FLAVORS = {"8B_4layers": ("8B", 4), "8B_8layers": ("8B", 8), "8B_flex_4layers": ("8B_flex", 4)}


def llama3_commopt_train_spec() -> Any:
    """torchtitan.models.llama3's TrainSpec with parallelize_fn = parallelize_llama_commopt
    and llama3's flavors plus EXTRA_FLAVORS."""
    from torchtitan.models.llama3 import get_train_spec

    spec = get_train_spec()
    flavors = dict(spec.model_args)
    for name, (base, layers) in EXTRA_FLAVORS.items():
        flavors[name] = dataclasses.replace(flavors[base], n_layers=layers)
    return dataclasses.replace(spec, parallelize_fn=parallelize_llama_commopt, model_args=flavors)


def register(name: str = TRAIN_SPEC_NAME) -> None:
    """Register the llama3 spec under `name` (model.name in the job config) and the MoE specs
    (moe.MOE_SPECS); a second call is a no-op, a different spec already under one of the names
    is a ValueError."""
    import torchtitan
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    from torch_commopt.integrations.torchtitan import TORCHTITAN_VERSION

    if getattr(torchtitan, "__version__", None) != TORCHTITAN_VERSION:
        log.warning("torch_commopt's torchtitan recipe is written for torchtitan %s, found %s",
                    TORCHTITAN_VERSION, getattr(torchtitan, "__version__", "unknown"))
    from torch_commopt.integrations.torchtitan.moe import MOE_SPECS, moe_train_spec

    def ours(spec) -> bool:
        fn = spec.parallelize_fn
        return fn is parallelize_llama_commopt or hasattr(fn, "commopt_base")

    for spec_name, build in [(name, llama3_commopt_train_spec)] + [(n, lambda n=n: moe_train_spec(n)) for n in MOE_SPECS]:
        try:
            existing = get_train_spec(spec_name)
        except ValueError:  # "TrainSpec ... is not registered."
            existing = None
        if existing is not None:
            if ours(existing):
                continue
            raise ValueError(f"torchtitan already has a train spec named {spec_name!r}; register commopt's under "
                             "another name")
        register_train_spec(spec_name, build())
