"""torchrun entry point: torchtitan 0.2.2's own trainer on CPU/gloo, for the smoke test only.

    torchrun --nproc_per_node 2 titan_cpu_train.py --job.config_file X.toml ...

torchtitan 0.2.2 assumes an accelerator; these shims (test code, not part of the recipe) let
its unchanged Trainer run on CPU:
  - tools/utils.py falls back to device type "cuda" when no accelerator is found: report "cpu"
    (then init_distributed picks gloo, the model is materialised on "cpu");
  - DeviceMemoryMonitor (components/metrics.py) asks the device module for a name, properties
    and memory statistics that torch.cpu does not have: constants;
  - set_pg_timeouts (distributed/utils.py) calls barrier(device_ids=[current_device()]), and
    torch.cpu.current_device() is the string "cpu": 0;
  - RowwiseParallel's output redistribute runs synchronously (async_op=False).  On torch 2.13 (CPU) the
    tensor-parallel styles' asynchronous redistribute of an eager module's output (llama3's
    tok_embeddings, RowwiseParallel) feeding a compiled block fails in backward
    (Redistribute.backward -> NestedRedistribute gets a plain Tensor: "'Tensor' object has no
    attribute '_local_tensor'"); stock torchtitan compiling with backend="aot_eager" fails the
    same way, so it is not commopt's; torch 2.11 has no NestedRedistribute.  The values are
    the same either way: only when the collective is waited for changes;
  - FSDP (data_parallel_shard_degree > 1) reduces gradients with ReduceOp.PREMUL_SUM once
    torchtitan sets the divide factor to 1, which gloo lacks: plain sums (the factor is 1);
  - FlexAttention (the *_flex_attn flavors) trains on CPU only through its eager operators:
    torch refuses gradients on a CPU at its public API (_validate_device) and Inductor's CPU
    flex has no backward, so the check is lifted and torchtitan's FlexAttentionWrapper calls
    flex_attention uncompiled (a commopt-compiled block still traces it into its graph).
Then it runs `torchtitan.train.main` with a Trainer that, when $TT_RESULT is set, writes per
rank to $TT_RESULT.<rank>.json: the logged losses, the class names of model.layers' children,
whether torch_commopt.optimize compiled them, and torch_commopt.explain()'s graphs (kinds,
rewritten regions, commopt ops emitted).

With $TT_JOBS (a JSON list of [port, [arguments]]) it runs those jobs one after another in
this process instead, each with the command line's arguments followed by its own, each writing
to $TT_RESULT.<job>.<rank>.json: the test's jobs pay for one start of torchrun and of the
imports (torch, torchtitan, datasets: ~10 s of the 2-core CI machine's time each) instead of
one per job.  Each job's process group has a store of its own on its port (rank 0 serves it):
a default group made again on the store of torchrun's agent hangs in gloo's rendezvous, whose
keys the first group left there.
"""

import json
import os
import time

import torch
import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan is imported


class _Props:
    total_memory = 64 * 2**30


for _name, _fn in {"get_device_name": lambda *a, **k: "cpu", "get_device_properties": lambda *a, **k: _Props(),
                   "memory_stats": lambda *a, **k: {}, "reset_peak_memory_stats": lambda *a, **k: None,
                   "empty_cache": lambda *a, **k: None}.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)
torch.cpu.current_device = lambda: 0

from torch.distributed.tensor.parallel import style as _tp_style  # noqa: E402


def _sync_rowwise_output(output_layouts, use_local_output, mod, outputs, device_mesh):
    """RowwiseParallel's output hook with a synchronous redistribute (the shim above)."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=False)
    return outputs.to_local() if use_local_output else outputs


# Not DTensor.redistribute itself: a Python wrapper there is traced by Dynamo in place of the
# method it knows, and a module compiled with its TP hooks (the output projection) then fails to
# trace the redistribute's autograd.Function ("get_active_debug_mode" is skipped).
_tp_style.RowwiseParallel._prepare_output_fn = staticmethod(_sync_rowwise_output)

import torchtitan.models.llama3.infra.parallelize as _llama3_parallelize  # noqa: E402

import torch_commopt  # noqa: E402
from torch_commopt.kernels.attention import flex  # noqa: E402
from torch_commopt.optimize import is_optimized  # noqa: E402

_disable_division = _llama3_parallelize.disable_fsdp_gradient_division


def _disable_division_gloo(model):
    _disable_division(model)
    for m in model.modules():
        if isinstance(m, _llama3_parallelize.FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


_llama3_parallelize.disable_fsdp_gradient_division = _disable_division_gloo
import torchtitan.models.llama4.infra.parallelize as _llama4_parallelize  # noqa: E402  (the MoE models' FSDP)

_llama4_parallelize.disable_fsdp_gradient_division = _disable_division_gloo

import torch.nn.attention.flex_attention as _flex  # noqa: E402
import torchtitan.models.attention as _titan_attention  # noqa: E402

_flex._validate_device = lambda *args, **kwargs: None
_titan_attention.FlexAttentionWrapper._compiled_flex_attn = _flex.flex_attention

from torch_commopt.testing.optional import torchtitan_moe_cpu_shims  # noqa: E402

torchtitan_moe_cpu_shims()  # the MoE models (deepseek_v3's debug flavor)
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.train import Trainer, main  # noqa: E402


class RecordingTrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.losses: list[float] = []
        log = self.metrics_processor.log

        def record(step, global_avg_loss, *args, **kwargs):
            self.losses.append(float(global_avg_loss))
            return log(step, global_avg_loss, *args, **kwargs)

        self.metrics_processor.log = record

    def train(self):
        super().train()
        path = os.environ.get("TT_RESULT")
        if not path:
            return
        graphs = torch_commopt.explain().graphs
        experts = [m for m in self.model_parts[0].modules() if hasattr(m, "w1") and getattr(m.w1, "dim", lambda: 0)() == 3]
        result = {
            "moe_schedules": [getattr(m, "_commopt_moe_schedule", None) for m in experts],
            "losses": self.losses,
            "blocks": [type(b).__name__ for b in self.model_parts[0].layers.children()],
            "optimized": [is_optimized(b) for b in self.model_parts[0].layers.children()],
            "output_optimized": is_optimized(self.model_parts[0].output),
            "graph_kinds": [g.graph_kind for g in graphs],
            "rewritten": [[r.kind, r.schedule] for g in graphs for r in g.rewritten],
            "commopt_ops": sum(sum(g.commopt_ops.values()) for g in graphs),
            "flex_notes": [n for g in graphs for n in g.notes if "cp_flex_attention" in n],
            "flex_cuts": dict(flex.CACHE_STATS),
        }
        with open(f"{path}.{torch.distributed.get_rank()}.json", "w") as f:
            json.dump(result, f)


class _TimeWithoutSleep:
    """torchtitan.train's `time` for run_jobs: Trainer.train sleeps 2 s on rank 0 at the end
    ("for other ranks to complete") before the group is destroyed; run_jobs waits for them at a
    barrier instead (2 s of each job's wall time, 12 of the test's)."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(seconds):
        pass


def run_jobs(jobs, base_args, result):
    """torchtitan.train.main's steps (parse, train, close, destroy the group) for each job."""
    import torchtitan.train
    from torchtitan.tools.logging import init_logger

    torchtitan.train.time = _TimeWithoutSleep()
    init_logger()
    for i, (port, args) in enumerate(jobs):
        os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False", TT_RESULT=f"{result}.{i}")
        torch._dynamo.reset()
        torch_commopt.reset_explain()
        flex.CACHE_STATS.update(hits=0, cuts=0)
        # not main(): ConfigManager.parse_args's default is sys.argv[1:] as it was at import
        trainer = RecordingTrainer(ConfigManager().parse_args([*base_args, *args]))
        try:
            trainer.train()
            torch.distributed.barrier()  # every rank done before rank 0's store goes with the group
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys

    if os.environ.get("TT_JOBS"):
        run_jobs(json.loads(os.environ["TT_JOBS"]), sys.argv[1:], os.environ["TT_RESULT"])
    else:
        main(RecordingTrainer)
