# The README's commands. Each creates/reuses .venv and installs what it needs.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch==2.13.0 resolves to the CPU wheel on these machines; an unpinned torch pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test test-fast lint quickstart clean

$(VENV)/.installed: setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]" "$(TORCH_PIN)"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not distributed and not integration and not vllm" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check sao_megatron tests tools
	$(VENV)/bin/ruff format --check sao_megatron tests tools

quickstart: install
	@echo "The main job (sao-train examples/configs/quickstart.yaml) lands with issue 7; not available yet." >&2
	@exit 2

clean:
	rm -rf $(VENV) build *.egg-info
