# One entry point per chore. The virtual environment is created on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A pinned torch first: it installs the CPU build from local disk; an unpinned one
# would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: venv browser test demo dashboard bench screenshots zoo gpu-check lint clean

venv: $(STAMP) browser

# The dashboard's browser tests drive the system Chromium (Playwright's own download
# cannot work offline). Installed with apt where we are root; else the tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } \
		|| echo "chromium not installed (needs root and apt): the browser tests will be skipped"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,plot,cli,bench]"
	touch $(STAMP)

test: $(STAMP) browser
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo: $(STAMP)
	$(BIN)/python -m lightning_scale.demo

dashboard: $(STAMP)
	$(BIN)/tensorboard --logdir lightning_logs --host 127.0.0.1

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out docs/benchmarks.md

# The docs' pictures, from real runs of today's code (headless Chromium; a few minutes).
screenshots: $(STAMP) browser
	$(BIN)/python benchmarks/screenshots.py --out docs
	$(BIN)/python examples/coord_check.py --out docs/coord_check.png --csv /tmp/coord_check.csv

# Real models compiled whole with Inductor (cold compiles: 15-60 s a model, more when loaded).
zoo: $(STAMP)
	$(BIN)/python benchmarks/models.py --zoo --out docs/models.md

gpu-check: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m gpu tests
	$(BIN)/python benchmarks/gpu.py

lint: $(STAMP)
	$(BIN)/python -m ruff check lightning_scale tests benchmarks examples

clean:
	rm -rf $(VENV) lightning_logs build *.egg-info
