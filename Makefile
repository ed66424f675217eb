# The README's two commands. Each creates .venv and installs what it needs by itself.
#   make test   lint, then run the test suite (all but the few `slow` planner tests: under 5 minutes on 2 cores)
#   make test-all  lint, then every test (what .ci/run runs)
#   make lint   ruff over the whole tree (tests and scripts included); the rule set is in pyproject.toml
#   make demo   fine-tune the embedded model on the embedded data (a few minutes on 2 CPU cores)
# GPU users: make test TORCH_SPEC='torch>=2.4' (keeps or installs a CUDA build instead of the CPU pin).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.looptrain-installed
# The demo's settings (docs/finetune.md has the timings): --amp is bf16 only where bf16 matmuls measure faster,
# length grouping removes padding, 5000 samples in 157 updates of 32 fit in about 3 minutes of training
# on 2 AVX2 cores. tests/test_finetune.py runs these arguments for a few steps so they cannot rot.
DEMO_ARGS ?= --amp --batch-size 8 --accum 4 --lr 1e-4 --group-by-length --max-train-samples 5000 --max-eval-samples 1000 --log-every 25
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test test-all lint demo install clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,demo,bench]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -q -m "not slow"

test-all: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	rm -rf runs/demo  # the demo's own directory: each `make demo` starts afresh
	$(PY) scripts/finetune.py $(DEMO_ARGS) --output-dir runs/demo

clean:
	rm -rf $(VENV) runs *.egg-info
