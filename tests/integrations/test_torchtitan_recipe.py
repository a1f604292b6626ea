"""The torchtitan recipe against torchtitan 0.2.2 itself (in the test extras; skipped where
torchtitan is not importable or is another version, except under CI, where that fails): the
[commopt] section through torchtitan's ConfigManager
(toml and CLI), the "llama3_commopt" train spec, parallelize_llama_commopt on one process, and
smoke runs of torchtitan's own trainer on CPU/gloo (titan_cpu_train.py: torchtitan shimmed
for CPU) comparing the losses of a few steps with commopt on and off.

Not tested here: GPUs, speed, activation checkpointing under TP (fails on torch 2.13 CPU with
backend="aot_eager" too; tests/test_checkpointing.py runs the nearest program that compiles),
FlexAttention, pipeline parallelism, checkpointing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from torch_commopt.testing.optional import torchtitan_or_skip

torchtitan_or_skip()

from torchtitan.config import ConfigManager  # noqa: E402

import torch_commopt  # noqa: E402
from torch_commopt.integrations.torchtitan.config import Commopt  # noqa: E402
from torch_commopt.integrations.torchtitan.parallelize import parallelize_llama_commopt  # noqa: E402
from torch_commopt.integrations.torchtitan.spec import TRAIN_SPEC_NAME, register  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
EXAMPLE_TOML = os.path.join(REPO, "torch_commopt", "integrations", "torchtitan", "llama3_debug_tp2_commopt.toml")
CONFIG_MODULE = "torch_commopt.integrations.torchtitan.config"


def _parse(args):
    return ConfigManager().parse_args(args)


def test_cli_overrides_reach_the_section():
    cfg = _parse(["--job.custom_config_module", CONFIG_MODULE, "--commopt.enable", "--commopt.chunks", "2",
                  "--commopt.options", '{"ar_split": true, "patterns": ["ag_matmul"]}'])
    assert isinstance(cfg.commopt, Commopt) and cfg.commopt.enable
    c = cfg.commopt.to_config()
    assert (c.chunks, c.ar_split, c.patterns) == (2, True, ("ag_matmul",))
    assert _parse(["--job.custom_config_module", CONFIG_MODULE]).commopt == Commopt()


def test_the_example_toml_parses_and_the_cli_wins():
    cfg = _parse(["--job.config_file", EXAMPLE_TOML])
    assert cfg.model.name == TRAIN_SPEC_NAME and cfg.parallelism.tensor_parallel_degree == 2
    assert cfg.training.dtype == "bfloat16"  # TP without FSDP: torchtitan would train in fp32 (fp32_tp_warning)
    assert cfg.commopt.enable and cfg.commopt.schedule == "auto"
    assert cfg.experimental.custom_import == "torch_commopt.integrations.torchtitan.register"
    cfg = _parse(["--job.config_file", EXAMPLE_TOML, "--commopt.schedule", "sequential", "--commopt.no-enable"])
    assert cfg.commopt.schedule == "sequential" and not cfg.commopt.enable


def test_a_bad_cli_option_stops_the_parse_naming_it(capsys):
    with pytest.raises(SystemExit):
        _parse(["--job.custom_config_module", CONFIG_MODULE, "--commopt.options", '{"chunk": 2}'])
    err = capsys.readouterr()
    assert "unknown key" in err.err + err.out and "chunk" in err.err + err.out


def test_the_train_spec_is_llama3_with_our_parallelize_fn():
    from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

    import torch_commopt.integrations.torchtitan.register  # noqa: F401  (registers)

    ours, stock = get_train_spec(TRAIN_SPEC_NAME), get_train_spec("llama3")
    assert ours.parallelize_fn is parallelize_llama_commopt
    for f in dataclasses.fields(TrainSpec):
        if f.name not in ("parallelize_fn", "model_args"):
            assert getattr(ours, f.name) == getattr(stock, f.name), f.name  # the same builders and classes
    assert {k: v for k, v in ours.model_args.items() if k in stock.model_args} == dict(stock.model_args)
    four = ours.model_args["8B_4layers"]  # llama3 8B's layers, four of them
    assert four.n_layers == 4 and dataclasses.replace(four, n_layers=32) == stock.model_args["8B"]
    flex = ours.model_args["8B_flex_4layers"]  # and llama3 8B_flex's (FlexAttention over documents)
    assert flex.n_layers == 4 and dataclasses.replace(flex, n_layers=32) == stock.model_args["8B_flex"]
    register()  # again: a no-op
    assert get_train_spec(TRAIN_SPEC_NAME) is ours
    with pytest.raises(ValueError, match="already has a train spec"):
        register("llama3")
    register_train_spec("commopt_test_other", stock)
    with pytest.raises(ValueError, match="commopt_test_other"):
        register("commopt_test_other")


def _one_process_job(*extra):
    cfg = _parse(["--job.custom_config_module", CONFIG_MODULE, "--model.name", TRAIN_SPEC_NAME,
                  "--training.seq_len", "32", *extra])
    from torchtitan.distributed import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return cfg, dims


def _small_llama(n_layers=2):
    from torchtitan.models.llama3 import Transformer, llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], n_layers=n_layers, max_seq_len=32)
    with torch.device("meta"):
        return Transformer(args)


# slow: make test runs parallelize inside torchtitan's trainer (the TP=2 smoke pair below)
@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_parallelize_compiles_each_block_with_commopt(ac):
    """One process, no parallelism: each TransformerBlock is compiled by commopt (after
    activation checkpointing when that is on) and the output equals the eager model's."""
    from torch_commopt.optimize import is_optimized

    cfg, dims = _one_process_job("--commopt.enable", "--commopt.schedule", "sequential",
                                 "--activation_checkpoint.mode", ac)
    torch._dynamo.reset()
    torch_commopt.reset_explain()
    model = parallelize_llama_commopt(_small_llama(), dims, cfg)
    blocks = list(model.layers.values())
    assert len(blocks) == 2 and all(is_optimized(b) for b in blocks)
    assert type(blocks[1]).__name__ == ("CheckpointWrapper" if ac == "selective" else "TransformerBlock")
    assert blocks[0]._commopt_config.schedule == "sequential"
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 2048, (2, 32))
    out = model(tokens)
    out.float().sum().backward()
    assert {g.graph_kind for g in torch_commopt.explain().graphs} >= {"forward", "backward"}
    for b in blocks:
        b._compiled_call_impl = None  # back to eager
    torch.testing.assert_close(out, model(tokens), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_parallelize_without_commopt_is_the_stock_function():
    cfg, dims = _one_process_job("--activation_checkpoint.mode", "none")
    model = parallelize_llama_commopt(_small_llama(), dims, cfg)
    assert all(type(b).__name__ == "TransformerBlock" and b._compiled_call_impl is None for b in model.layers.values())


def test_parallelize_refuses_async_tp_memory_budget_ac_and_a_missing_section():
    cfg, dims = _one_process_job("--commopt.enable", "--parallelism.enable_async_tensor_parallel")
    with pytest.raises(ValueError, match="enable_async_tensor_parallel"):
        parallelize_llama_commopt(_small_llama(), dims, cfg)
    cfg, dims = _one_process_job("--commopt.enable", "--activation_checkpoint.mode", "memory_budget")
    with pytest.raises(ValueError, match="memory_budget"):
        parallelize_llama_commopt(_small_llama(), dims, cfg)
    bare = ConfigManager().parse_args(["--model.name", TRAIN_SPEC_NAME])
    with pytest.raises(ValueError, match="custom_config_module"):
        parallelize_llama_commopt(_small_llama(), dims, bare)


# -- smoke runs of torchtitan's trainer on CPU/gloo ----------------------------------------

STEPS = 3  # the first step runs the initial weights, the others two updates of them
FP32 = ("--training.dtype", "float32")  # the toml's bf16 is for GPUs; fp32 keeps the comparisons tight
BF16 = ("--training.dtype", "bfloat16")
# name -> the job's arguments after the example toml's: each smoke test compares a pair of them
# deepseek_v3's debug flavor (1 dense + 5 MoE layers, 8 experts, top-3) with EP=2 over FSDP=2
MOE_EP2 = ("--model.name", "deepseek_v3_commopt", "--model.flavor", "debugmodel", "--parallelism.tensor_parallel_degree",
           "1", "--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
           "--training.mixed_precision_param", "float32", *FP32)
# llama3's debug flavor with FlexAttention (block-causal over the documents) and CP=2: torch's
# context_parallel (its head-tail load balancer) over FSDP; 512 tokens (two 128-token blocks a rank)
CP2_FLEX = ("--model.flavor", "debugmodel_flex_attn", "--parallelism.tensor_parallel_degree", "1",
            "--parallelism.context_parallel_degree", "2", "--training.mixed_precision_param", "float32",
            "--training.seq_len", "512", *FP32)
JOBS = {
    "tp2 eager": ("--commopt.no-enable", *FP32), "tp2": FP32,
    "tp2 bf16 eager": ("--commopt.no-enable", *BF16), "tp2 bf16": BF16,
    "moe ep2 eager": ("--commopt.no-enable", *MOE_EP2), "moe ep2": ("--commopt.options", '{"moe_schedule": "by_peer"}', *MOE_EP2),
    "cp2 flex eager": ("--commopt.no-enable", *CP2_FLEX), "cp2 flex": CP2_FLEX,
}


TP2_PAIR = ("tp2 eager", "tp2")  # make test's tier trains this pair; the slow tier the rest of JOBS


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(tmp_path_factory, names):
    """The jobs `names` of JOBS trained by torchtitan's trainer (titan_cpu_train.py) on 2 gloo
    ranks with the example toml, one job after another in one torchrun (its start and the
    imports paid once); {name: each rank's result (losses, block classes, explain summary)}."""
    pytest.importorskip("tokenizers")
    from torch_commopt.integrations.torchtitan.assets import write_debug_assets

    nproc, out = 2, tmp_path_factory.mktemp("tt_run")
    tok_dir, data_dir = write_debug_assets(str(out / "assets"), docs=100, words_per_doc=200)
    jobs = [[_free_port(), [*JOBS[name], "--job.dump_folder", str(out / f"dump{i}")]] for i, name in enumerate(names)]
    env = dict(os.environ, TT_RESULT=str(out / "result"), TT_JOBS=json.dumps(jobs), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, *[p for p in sys.path if p]]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.join(HERE, "titan_cpu_train.py"),
           "--job.config_file", EXAMPLE_TOML, "--model.hf_assets_path", tok_dir, "--training.dataset_path", data_dir,
           "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
           "--debug.seed", "7", "--metrics.log_freq", "1"]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = {}
    for i, name in enumerate(names):
        results[name] = []
        for rank in range(nproc):
            with open(out / f"result.{i}.{rank}.json") as f:
                results[name].append(json.load(f))
    return results


@pytest.fixture(scope="module")
def trained_tp2(tmp_path_factory):
    """The TP=2 + SP pair in fp32: the recipe's main path, in make test's tier."""
    return _train(tmp_path_factory, list(TP2_PAIR))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The other pairs (bf16, MoE, CP + FlexAttention): the slow tier (make test-all)."""
    return _train(tmp_path_factory, [name for name in JOBS if name not in TP2_PAIR])


def _check(results, eager, *, rewritten, rtol):
    losses = results[0]["losses"]
    assert len(losses) == STEPS and all(r["losses"] == losses for r in results)  # every rank logs the global loss
    for r in results:
        assert r["optimized"] == [True] * 6, r["blocks"]
        assert {"forward", "backward"} <= set(r["graph_kinds"]), r["graph_kinds"]
        assert {k for k, _ in r["rewritten"]} == rewritten, r["rewritten"]
    assert eager[0]["graph_kinds"] == [] and not any(eager[0]["optimized"])
    torch.testing.assert_close(losses, eager[0]["losses"], rtol=rtol, atol=0)
    return losses


def test_smoke_tp2_sp_trains_like_eager(trained_tp2):
    """llama3 debugmodel, TP=2 + SP, 2 gloo ranks: commopt rewrites the TP all-gather/matmul
    and matmul/reduce-scatter pairs in forward and backward, and the loss of every step
    equals the same job without commopt (fp32 on CPU; the chunked schedule only reorders
    when pieces arrive)."""
    losses = _check(trained_tp2["tp2"], trained_tp2["tp2 eager"], rewritten={"ag_matmul", "matmul_rs"}, rtol=1e-5)
    print("TP=2 losses (commopt):", losses, "eager:", trained_tp2["tp2 eager"][0]["losses"])


@pytest.mark.slow
def test_smoke_tp2_in_bf16_as_the_toml_sets(trained):
    """The toml's training.dtype = bfloat16 (what the GPU runs use): TP=2 + SP trains through
    commopt's rewritten regions, losses within bf16 noise of the job without commopt."""
    losses = _check(trained["tp2 bf16"], trained["tp2 bf16 eager"], rewritten={"ag_matmul", "matmul_rs"}, rtol=2e-2)
    # the output projection too (ColwiseParallel on itself, no FSDP): its gather and matmul in one graph
    assert all(r["output_optimized"] for r in trained["tp2 bf16"]) and not trained["tp2 bf16 eager"][0]["output_optimized"]
    print("TP=2 bf16 losses (commopt):", losses, "eager:", trained["tp2 bf16 eager"][0]["losses"])


@pytest.mark.slow
def test_smoke_moe_ep2_exchanges_through_commopt_and_trains_like_torchtitan(trained):
    """deepseek_v3 debugmodel with EP=2 over FSDP=2 (2 gloo ranks, fp32): the train spec
    "deepseek_v3_commopt" swaps each MoE layer's token exchange for commopt's by_peer after
    torchtitan's own parallelize, and the losses of every step equal torchtitan's own EP job's."""
    ours, theirs = trained["moe ep2"], trained["moe ep2 eager"]
    for r in ours:
        assert r["moe_schedules"] == ["by_peer"] * 5, r["moe_schedules"]
    assert theirs[0]["moe_schedules"] == [None] * 5
    losses = ours[0]["losses"]
    assert len(losses) == STEPS and all(r["losses"] == losses for r in ours)
    torch.testing.assert_close(losses, theirs[0]["losses"], rtol=1e-5, atol=0)
    print("MoE EP=2 losses (commopt by_peer):", losses, "torchtitan:", theirs[0]["losses"])


@pytest.mark.slow
def test_smoke_fsdp_cp2_flex_attention_runs_commopts_flex_schedule_and_trains_like_eager(trained):
    """llama3 debugmodel with FlexAttention (block-causal over documents) and CP=2 (2 gloo ranks,
    fp32 parameters), so FSDP over the CP ranks too: the blocks, compiled in place after
    fully_shard registered its hooks on them, compile whole (fullgraph) with FSDP's hooks left to
    run eagerly; torch's context_parallel gathers K/V with its cplib op inside each compiled
    block, commopt runs the attention as cp_flex_attention_fwd/bwd (the model's pick; no TP, so no
    matmul region), the mask is cut once a step, and the losses of every step equal the same job
    without commopt."""
    ours = trained["cp2 flex"]
    losses = _check(ours, trained["cp2 flex eager"], rewritten=set(), rtol=1e-5)
    assert all(b.startswith("FSDP") for b in ours[0]["blocks"])
    for r in ours:
        assert any("cp_flex_attention_fwd/bwd" in n for n in r["flex_notes"]), r["flex_notes"]
        # one cut of the step's mask for every layer's forward and backward: each block's graph
        # hands its attention another tensor object for a mask buffer (a cut per call cost ~3 ms of
        # host time each and a host read: 1.6x inductor's step on 2x H200)
        assert r["flex_cuts"] == {"cuts": STEPS, "hits": STEPS * (2 * 6 - 1)}, r["flex_cuts"]
    print("CP=2 flex losses (commopt):", losses, "eager:", trained["cp2 flex eager"][0]["losses"])
