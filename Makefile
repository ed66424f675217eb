# The README's two commands. Each creates .venv and installs what it needs by itself.
#   make test   run the test suite
#   make demo   fine-tune the embedded model on the embedded data (a few minutes on 2 CPU cores)
# GPU users: make test TORCH_SPEC='torch>=2.4' (keeps or installs a CUDA build instead of the CPU pin).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.looptrain-installed
DEMO_ARGS ?= --amp --accum 32 --batch-size 4 --lr 2e-4 --max-train-samples 4000 --max-eval-samples 1000 --log-every 8
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test demo install clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,demo,bench]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) scripts/finetune.py $(DEMO_ARGS) --output-dir runs/demo

clean:
	rm -rf $(VENV) runs *.egg-info
