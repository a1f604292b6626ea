# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first, pinned: pip then takes the CPU wheel on disk instead of a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-all lint test-gpu clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m torch_commopt demo

# TEST_WORKERS pytest-xdist workers, tests dealt one at a time (--dist load; keeping a module on
# one worker measured slower). 2 is CI's core count; many tests start rank processes of their own,
# so the second worker saves about a sixth, not half.  Where xdist is missing the suite runs serially.
# make test leaves out the tests marked slow (more world sizes and parametrizations of what its
# own cases drive, the torchtitan pairs beyond TP=2): CI's 15 minutes; make test-all runs them too.
# --durations: CI's log names its slowest tests (its machine's speed varies about 2x).
TEST_WORKERS ?= 2
XDIST = $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist load")
test: $(VENV)/.installed
	$(PY) -m pytest -q tests --ignore=tests/gpu -m "not slow" --durations=12 $(XDIST)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q tests --ignore=tests/gpu $(XDIST)

# The layer contract (.importlinter: imports run one way, no cycles) and the linter; .ci/run runs both.
lint: $(VENV)/.installed
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

# On a machine with >= 2 GPUs (the device machine); uses the python3 that has CUDA torch.
test-gpu:
	NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
	  $(PYTHON) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) *.egg-info
