"""torchtitan recipe: switch commopt on from a torchtitan job config.

Pinned version: torchtitan 0.2.2 (git tag v0.2.2, 2026-02-20), the release whose torch pin
matches torch 2.11.  torchtitan 0.3.0 needs torch >= 2.14 and has another config system
(docs/torchtitan.md); this recipe checks for 0.2.2's hooks and raises
if they are missing.

What it adds (torchtitan itself is unchanged and imported, never copied):

  config.py       the `[commopt]` section: `enable` plus torch_commopt.Config options (flat
                  `schedule`, `mode`, `chunks`; any other field in `options`, a JSON object),
                  validated when torchtitan builds the config (ValueError naming the key).
                  Named by `job.custom_config_module`.
  register.py     importing it registers the train specs (spec.py): "llama3_commopt", llama3's
                  own spec with parallelize_fn = parallelize_llama_commopt, and the MoE
                  flavors' "deepseek_v3_commopt" and "qwen3_commopt" (moe.py: torchtitan's
                  parallelize, then commopt's token exchange in every expert-parallel MoE
                  layer).  Named by `experimental.custom_import`.
  parallelize.py  parallelize_llama_commopt: torchtitan's parallelize_llama (TP/SP, CP, AC,
                  FSDP/HSDP/DDP unchanged) with its model compile off, then each
                  TransformerBlock compiled in place by torch_commopt.optimize(block,
                  fullgraph=True, dynamic=False, <the section's options>);
                  `commopt.enable = false` runs the stock function.  With CP and
                  FlexAttention (llama3's *_flex_attn flavors) torch's context_parallel
                  gathers K/V with its cplib op inside each compiled block, and commopt runs
                  the attention as its flex schedules (docs/flex-attention.md; CPU smoke in
                  tests/integrations).
  assets.py       a synthetic tokenizer and c4_test-style data set for offline debug runs.
  llama3_debug_tp2_commopt.toml   the example job: llama3 debugmodel, TP=2 + SP, commopt on.

Why a train spec and not `[compile] backend = "commopt"`: torchtitan passes only the backend
name (no options, no dynamic=False) and the same backend compiles the loss; torchtitan 0.3.0
also refuses backends other than inductor/aot_eager for FlexAttention models.  The train spec
keeps `[compile]` for the loss and routes the blocks through commopt with its options.
Refused with commopt.enable (ValueError): async TP, activation_checkpoint.mode="memory_budget".

Install (GPU machine, torch 2.11 already there; no network, so carry the wheels --
benchmarks/torchtitan_wheels.sh builds exactly the set that machine lacks into .whl/):

    # torchtitan-0.2.2-py3-none-any.whl (pure Python, ~450 KB), built from the tag:
    git -C torchtitan checkout v0.2.2 && pip wheel --no-deps --no-build-isolation ./torchtitan
    pip install --no-deps torchtitan-0.2.2-py3-none-any.whl <the wheels below>
    pip install --no-deps -e .            # torch_commopt (or PYTHONPATH=<this repo>)

    wheels torchtitan 0.2.2 imports on the llama3 path (versions verified on CPU):
      torchdata 0.11.0, tyro 1.0.17 (+ docstring_parser 0.18.0, typeguard 4.6.0),
      tokenizers 0.23.3, einops 0.8.2, tensorboard 2.21.0 (+ absl-py 2.5.1, protobuf 7.36.2,
      six 1.17.0), datasets 4.7.0 (+ pyarrow 26.0.1, pandas 3.1.1, python-dateutil,
      tzdata, dill 0.4.1, multiprocess 0.70.19, xxhash 4.1.0, huggingface_hub 2.4.0, httpx,
      httpcore/h11, certifi, idna, requests, urllib3, tqdm, pyyaml), fsspec, filelock

Launch (2 GPUs, from this repository's root):

    python -m torch_commopt.integrations.torchtitan.assets tt_assets
    torchrun --standalone --nproc_per_node 2 -m torchtitan.train \\
        --job.config_file torch_commopt/integrations/torchtitan/llama3_debug_tp2_commopt.toml

    # the toml reads the tokenizer and data from tt_assets/ in the directory torchrun starts in
    # (written by the first line) and writes its outputs to outputs/ there;
    # elsewhere: --model.hf_assets_path DIR/tokenizer --training.dataset_path DIR/c4_test

    # options from the CLI, e.g.:  --commopt.mode model  --commopt.options '{"debug_waits": true}'
    # the same job without commopt:  --commopt.no-enable
    # (torchtitan's own tests/assets/tokenizer and c4_test from a full checkout of the tag work
    #  too; the synthetic ones exist because the GPU machine is offline)

Tested on CPU/gloo with torch 2.13 only (tests/integrations): the section's parsing and
validation, the CLI and toml plumbing through torchtitan's ConfigManager, the train spec
registration, parallelize_llama_commopt on one process (with and without activation
checkpointing), and torchtitan's own trainer (shimmed for CPU, tests/integrations/
titan_cpu_train.py) for 3 steps with TP=2 + SP, with FSDP=2 and (deepseek_v3) with EP=2: losses equal to the same job
without commopt.  On the GPU machine (torch 2.11, one H200; benchmarks/bench_torchtitan.py,
wheels from benchmarks/torchtitan_wheels.sh): installs from the carried wheels and trains 20
steps with TP=1, losses equal to the inductor job's at every step.  Not tested: TP on GPUs,
speed, activation checkpointing
with TP under compile (fails on torch 2.13 CPU with backend="aot_eager" too), FlexAttention
flavors, context and pipeline parallelism, checkpoint save/load.
"""

TORCHTITAN_VERSION = "0.2.2"

__all__ = ["TORCHTITAN_VERSION"]
