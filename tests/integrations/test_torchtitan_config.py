"""The torchtitan recipe's own plumbing, without torchtitan: the [commopt] section's parsing
and validation, the example job file, compile_blocks, and that every module of the recipe
imports with torchtitan absent.  (tests/integrations/test_torchtitan_recipe.py runs the parts
that need torchtitan.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
import torch
from torch import nn

import torch_commopt
from torch_commopt.config import Config
from torch_commopt.integrations.torchtitan import TORCHTITAN_VERSION
from torch_commopt.integrations.torchtitan.config import Commopt, JobConfig, commopt_section
from torch_commopt.integrations.torchtitan.parallelize import compile_blocks

RECIPE_DIR = os.path.dirname(os.path.abspath(sys.modules["torch_commopt.integrations.torchtitan"].__file__))
EXAMPLE_TOML = os.path.join(RECIPE_DIR, "llama3_debug_tp2_commopt.toml")


def test_defaults_are_configs_defaults():
    assert Commopt().enable is False
    assert Commopt().to_config() == Config()
    assert JobConfig().commopt == Commopt()


def test_flat_fields_and_json_options_merge():
    section = Commopt(enable=True, schedule="chunked", chunks=2,
                      options='{"ar_split": "checked", "patterns": ["ag_matmul", "matmul_rs"]}')
    cfg = section.to_config()
    assert (cfg.schedule, cfg.chunks, cfg.ar_split) == ("chunked", 2, "checked")
    assert cfg.patterns == ("ag_matmul", "matmul_rs")
    assert section.option_dict() == {"schedule": "chunked", "chunks": 2, "ar_split": "checked",
                                     "patterns": ["ag_matmul", "matmul_rs"]}
    # a toml inline table arrives as a dict
    assert Commopt(options={"mode": "model", "memory_budget_mib": 256}).to_config().memory_budget_mib == 256
    # every region's calls from per-call graphs (bench_torchtitan's commopt-call-graphs-all)
    assert Commopt(options='{"call_graphs": "all"}').to_config().call_graphs == "all"
    # host-bound graphs left to Inductor (bench_torchtitan's commopt-host-bound-inductor)
    assert Commopt(options='{"host_bound_graphs": "inductor"}').to_config().host_bound_graphs == "inductor"


@pytest.mark.parametrize("kwargs, names", [
    ({"options": '{"chunk": 2}'}, ["unknown key", "chunk"]),
    ({"chunks": 0}, ["Config.chunks", "0"]),
    ({"mode": "fastest"}, ["Config.mode", "fastest"]),
    ({"schedule": "warp"}, ["Config.schedule", "warp"]),
    ({"mode": "model", "schedule": "chunked"}, ["Config.mode", "chunked"]),
    ({"options": '{"ar_split": "sometimes"}'}, ["Config.ar_split", "sometimes"]),
    ({"options": '{"call_graphs": "most"}'}, ["Config.call_graphs", "most"]),
    ({"options": '{"host_bound_graphs": "nccl"}'}, ["Config.host_bound_graphs", "nccl"]),
    ({"chunks": 2, "options": '{"chunks": 3}'}, ["'chunks'", "commopt.chunks", "commopt.options"]),
    ({"options": '{"chunks": 2'}, ["commopt.options", "not valid JSON"]),
    ({"options": "[1, 2]"}, ["commopt.options", "JSON object"]),
    ({"enable": "yes"}, ["commopt.enable"]),
    ({"chunks": 0}, ["Config.chunks", "(commopt.chunks)"]),
    ({"schedule": "sequential:3"}, ["Config.schedule", "sequential:3", "no piece count", "(commopt.schedule)"]),
    ({"schedule": "fused:2:bm=64,bm=128"}, ["Config.schedule", "twice"]),
    ({"options": '{"consistency_timeout_s": NaN}'}, ["Config.consistency_timeout_s", "nan", "(in commopt.options)"]),
    ({"options": '{"consistency_timeout_s": Infinity}'}, ["Config.consistency_timeout_s", "inf"]),
    ({"options": {"saved_gather_budget_mib": float("nan")}}, ["Config.saved_gather_budget_mib", "nan"]),
    ({"mode": "model", "options": {"memory_budget_mib": float("inf")}}, ["Config.memory_budget_mib", "inf"]),
    ({"options": '{"attention_schedule": "ulysses:g=2:early"}'}, ["Config.attention_schedule", "ulysses:g=2:early"]),
])
def test_bad_options_raise_naming_them_when_the_section_is_built(kwargs, names):
    with pytest.raises(ValueError) as err:
        Commopt(**kwargs)
    msg = str(err.value)
    assert msg.startswith("[commopt]"), msg
    for name in names:
        assert name in msg, (name, msg)


def test_a_toml_section_with_non_finite_numbers_is_refused_when_loaded():
    """toml writes nan and inf bare: the section built from the parsed file refuses them, as
    torchtitan builds it from the file before training starts."""
    job = tomllib.loads('[commopt]\nenable = true\noptions = { consistency_timeout_s = nan }\n')
    with pytest.raises(ValueError, match="Config.consistency_timeout_s"):
        Commopt(**job["commopt"])
    job = tomllib.loads('[commopt]\nenable = true\noptions = { consistency_timeout_s = 10.0 }\n')
    assert Commopt(**job["commopt"]).to_config().consistency_timeout_s == 10.0


def test_a_job_config_without_the_section_says_how_to_add_it():
    class Bare:
        pass

    with pytest.raises(ValueError, match="custom_config_module"):
        commopt_section(Bare())
    job = JobConfig(commopt=Commopt(enable=True))
    assert commopt_section(job).enable


def test_the_example_job_switches_commopt_on_for_the_registered_spec():
    with open(EXAMPLE_TOML, "rb") as f:
        job = tomllib.load(f)
    from torch_commopt.integrations.torchtitan.spec import TRAIN_SPEC_NAME

    assert job["job"]["custom_config_module"] == "torch_commopt.integrations.torchtitan.config"
    assert job["experimental"]["custom_import"] == "torch_commopt.integrations.torchtitan.register"
    assert job["model"]["name"] == TRAIN_SPEC_NAME and job["model"]["flavor"] == "debugmodel"
    assert job["parallelism"]["tensor_parallel_degree"] == 2
    assert not job["parallelism"]["enable_async_tensor_parallel"]
    section = Commopt(**job["commopt"])
    assert section.enable and isinstance(section.to_config(), Config)
    assert TORCHTITAN_VERSION == "0.2.2"


def test_the_example_job_reads_and_writes_beside_where_it_starts():
    """The job's paths are relative (to the directory torchrun starts in): no fixed shared
    path such as one under /tmp, which another user's files could stand in for."""
    with open(EXAMPLE_TOML, "rb") as f:
        job = tomllib.load(f)
    paths = [job["job"]["dump_folder"], job["model"]["hf_assets_path"], job["training"]["dataset_path"]]
    assert not any(os.path.isabs(p) for p in paths), paths


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.relu(self.lin(x)) + x


def test_compile_blocks_compiles_each_layer_in_place_with_commopt():
    """Each child of model.layers is compiled in place by torch_commopt.optimize with the
    given Config (names and state-dict keys unchanged); the commopt backend sees their graphs;
    the values are the eager ones."""
    from torch_commopt.optimize import is_optimized

    torch._dynamo.reset()
    torch_commopt.reset_explain()
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): _Block(8) for i in range(3)})
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    want = x
    for b in model.layers.values():
        want = b(want)
    cfg = Config(schedule="sequential")
    assert compile_blocks(model, cfg) == 3
    assert list(model.state_dict()) == keys
    got = x
    for b in model.layers.values():
        assert is_optimized(b) and b._commopt_config == cfg
        got = b(got)
    torch.testing.assert_close(got, want)
    assert len(torch_commopt.explain().graphs) >= 1  # the backend ran
    torch._dynamo.reset()

    with pytest.raises(ValueError, match="layers"):
        compile_blocks(nn.Linear(2, 2), Config())


def test_the_recipe_imports_without_torchtitan():
    """Every module but register.py (which registers with torchtitan by design) imports with
    torchtitan made unimportable, in a fresh interpreter."""
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "import torch_commopt.integrations, torch_commopt.integrations.torchtitan as t\n"
        "import torch_commopt.integrations.torchtitan.config, torch_commopt.integrations.torchtitan.parallelize\n"
        "import torch_commopt.integrations.torchtitan.spec, torch_commopt.integrations.torchtitan.assets\n"
        "try:\n"
        "    import torch_commopt.integrations.torchtitan.register\n"
        "except ImportError:\n"
        "    print('register needs torchtitan')\n"
        "print(t.TORCHTITAN_VERSION)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["register", "needs", "torchtitan", "0.2.2"], out.stdout


def test_synthetic_assets(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from torch_commopt.integrations.torchtitan.assets import BOS, EOS, VOCAB, write_debug_assets

    tok_dir, data_dir = write_debug_assets(str(tmp_path), docs=5, words_per_doc=20)
    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB + 3 and tok.token_to_id(BOS) == 1 and tok.token_to_id(EOS) == 2
    with open(os.path.join(data_dir, "data.json")) as f:
        docs = [json.loads(line)["text"] for line in f]
    assert len(docs) == 5 and all(len(d.split()) == 20 for d in docs)
    assert tok.encode(docs[0]).ids == [tok.token_to_id(w) for w in docs[0].split()]  # no unknown words
    again = tmp_path / "again"
    write_debug_assets(str(again), docs=5, words_per_doc=20)
    assert (again / "c4_test" / "data.json").read_text() == "\n".join(json.dumps({"text": d}) for d in docs) + "\n"


def test_a_tp_job_without_fsdp_that_would_train_in_float32_is_warned_about():
    """torchtitan 0.2.2 gives TP without FSDP no mixed precision (pytorch/torchtitan#630)."""
    from types import SimpleNamespace as NS

    from torch_commopt.integrations.torchtitan.parallelize import fp32_tp_warning

    def dims(tp=1, pp=1, fsdp=False):
        return NS(tp_enabled=tp > 1, pp_enabled=pp > 1, fsdp_enabled=fsdp)

    def job(dtype="float32", mp="bfloat16"):
        return NS(training=NS(dtype=dtype, mixed_precision_param=mp))

    assert "trains in float32" in fp32_tp_warning(dims(tp=2), job())
    assert "trains in float32" in fp32_tp_warning(dims(pp=2), job())
    assert fp32_tp_warning(dims(tp=2), job(dtype="bfloat16")) is None  # the recipe's toml
    assert fp32_tp_warning(dims(tp=2, fsdp=True), job()) is None  # fully_shard's mixed precision
    assert fp32_tp_warning(dims(), job()) is None  # one device / DDP: torchtitan's autocast
    assert fp32_tp_warning(dims(tp=2), job(mp="float32")) is None  # float32 asked for
