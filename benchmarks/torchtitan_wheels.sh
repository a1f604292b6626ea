#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with torchtitan 0.2.2 and the packages the GPU machine lacks for it,
# for `run` with carry: [".whl"] and `bash tests/gpu/device_run.sh $OUT torchtitan`.
# Usage (repository root): bash benchmarks/torchtitan_wheels.sh TORCHTITAN_V0_2_2_SOURCE_DIR
#   the source: e.g. `fetch github:pytorch/torchtitan`, then (the mirror lacks some large test
#   assets, so archive only what the wheel needs; assets/version.txt gives its version)
#   src=$(mktemp -d)
#   git --git-dir=/work/.mirror/pytorch+torchtitan/repo archive v0.2.2 \
#     pyproject.toml torchtitan README.md LICENSE assets/version.txt | tar -x -C "$src"
# What the GPU machine (torch 2.11, Python 3.12) had on 2026-11-23 and lacked: torchdata, tyro,
# docstring_parser, typeguard, datasets, tzdata, dill, multiprocess (pyarrow, pandas,
# tokenizers, tensorboard, huggingface_hub, ... are there).  ~1.9 MB in all.
set -euo pipefail
src=${1:?torchtitan v0.2.2 source directory}
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl
"$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$src"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
  torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.0 datasets==4.7.0 tzdata \
  dill==0.4.1 multiprocess==0.70.19
ls .whl
