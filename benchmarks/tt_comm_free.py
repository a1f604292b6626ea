"""A bound for the torchtitan benchmark: the inductor job with the collectives of its compiled
graphs taken out (bench_torchtitan.py's `inductor-comm-free` variant).

Named as torchtitan's `--experimental.custom_import`.  It imports tt_profile first (the recipe's
train spec, and --profile-step keeps working), then sets Inductor's post-grad custom pass to
benchmarks/comm_free.py's, which replaces every functional collective in the compiled graphs by
a local stand-in, with the FX graph and AOTAutograd caches off so that no compiled program of
another job is reused.  torchtitan compiles the TransformerBlocks (and the loss) with Inductor, so
what is left is the blocks' computation with no communication, beside everything torchtitan runs
eagerly with its own collectives (the embedding's, the output projection's, the loss's): the step
time that hiding every block's communication could at best reach.  Its losses are meaningless.
"""

from __future__ import annotations

import torch
import torch._functorch.config as functorch_config

import benchmarks.tt_profile  # noqa: F401  (the train spec; the profiled step if asked)
from benchmarks import comm_free

for _name, _value in comm_free.OPTIONS.items():
    setattr(torch._inductor.config, _name, _value)
functorch_config.enable_autograd_cache = False
