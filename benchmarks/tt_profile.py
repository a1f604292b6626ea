"""Where one torchtitan training step's time goes (bench_torchtitan.py --profile-step N).

Named as torchtitan's `--experimental.custom_import` (it imports the recipe's register module
first, so the commopt train spec stays registered).  When TT_PROFILE_STEP=N is set, the
trainer's N-th `train_step` runs under torch.profiler (CPU and CUDA activity) and rank 0
prints two tables into the job's log between "commopt-tt-profile" markers: the top ops by
device time and by host time.  Every rank profiles the same step (collectives), only rank 0
prints.  Nothing changes without the variable.
"""

from __future__ import annotations

import functools
import os

import torch_commopt.integrations.torchtitan.register  # noqa: F401  (the train spec)

ENV = "TT_PROFILE_STEP"


def _install() -> None:
    step_to_profile = int(os.environ.get(ENV, "0") or 0)
    if step_to_profile <= 0:
        return
    import sys

    import torch
    from torch.profiler import ProfilerActivity, profile

    # `python -m torchtitan.train` runs the trainer as __main__ and imports this module from
    # Trainer.__init__: patch that class (importing torchtitan.train would load a second copy)
    trainer_cls = getattr(sys.modules["__main__"], "Trainer", None)
    if trainer_cls is None:
        from torchtitan.train import Trainer as trainer_cls
    original = trainer_cls.train_step
    calls = {"n": 0}

    @functools.wraps(original)
    def train_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] != step_to_profile:
            return original(self, *args, **kwargs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = original(self, *args, **kwargs)
            torch.cuda.synchronize()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            table = prof.key_averages()
            print(f"commopt-tt-profile begin (train_step call {step_to_profile})", flush=True)
            print(table.table(sort_by="device_time_total", row_limit=30), flush=True)
            print(table.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
            print("commopt-tt-profile end", flush=True)
        return result

    trainer_cls.train_step = train_step


_install()
