# One entry point per chore. The virtual environment is created on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A pinned torch first: it installs the CPU build from local disk; an unpinned one
# would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: venv test demo bench gpu-check lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,plot,cli,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(BIN)/python -m lightning_scale.demo

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out docs/benchmarks.md

gpu-check: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests
	$(BIN)/python benchmarks/gpu.py

lint: $(STAMP)
	$(BIN)/python -m ruff check lightning_scale tests benchmarks examples

clean:
	rm -rf $(VENV) lightning_logs build *.egg-info
