"""Where one torchtitan training step's time goes (bench_torchtitan.py --profile-step N).

Named as torchtitan's `--experimental.custom_import` (it imports the recipe's register module
first, so the commopt train spec stays registered).  When TT_PROFILE_STEP=N is set, the
trainer's N-th `train_step` runs under torch.profiler (CPU and CUDA activity) and rank 0
prints two tables into the job's log between "commopt-tt-profile" markers: the top ops by
device time and by host time.  Every rank profiles the same step (collectives), only rank 0
prints.  With TT_TRACE_DIR set too, every rank also writes that step's Chrome trace there, with
the Python stack of every host op (`<variant>_rank<r>.json`): which code called a host sync, and
what each rank's device waited for.  Nothing changes without the variables.
"""

from __future__ import annotations

import functools
import os

import torch_commopt.integrations.torchtitan.register  # noqa: F401  (the train spec)

ENV = "TT_PROFILE_STEP"
TRACE_ENV = "TT_TRACE_DIR"  # where each rank writes the profiled step's Chrome trace (optional)


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
        trace_dir = os.environ.get(TRACE_ENV)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(trace_dir)) as prof:
            result = original(self, *args, **kwargs)
            torch.cuda.synchronize()
        if trace_dir:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"{os.environ.get('TT_VARIANT', 'step')}_rank{rank}.json"))
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            table = prof.key_averages()
            print(f"commopt-tt-profile begin (train_step call {step_to_profile})", flush=True)
            print(table.table(sort_by="device_time_total", row_limit=30), flush=True)
            print(table.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
            print("commopt-tt-profile end", flush=True)
        return result

    trainer_cls.train_step = train_step


_install()
