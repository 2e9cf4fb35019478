# Two commands: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test demo lint env clean

env: $(STAMP)

# torch first: the pinned CPU wheel; then the project, whose torch range 2.13.0 satisfies. Where pip's
# index serves torch's CUDA build for Linux (stock PyPI), TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build from PyTorch's own index instead.
TORCH_INDEX ?=
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# two pytest-xdist workers, one per core (CI's 2 cores; tests/conftest.py gives each worker its share of
# torch threads): 11 min instead of 16.5 here; TEST_WORKERS=0 runs the suite in one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist worksteal)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# the run, then its model as a PEFT adapter (runs/demo/export) and that adapter's predictions for a few sentences
demo: $(STAMP)
	$(VENV)/bin/fedpeft run configs/demo_sst2_lora.yaml --run-dir runs/demo --plot
	$(VENV)/bin/fedpeft export runs/demo --out runs/demo/export --format peft
	$(VENV)/bin/fedpeft predict runs/demo/export --input configs/demo_predict.csv --output runs/demo/predictions.csv
	cat runs/demo/predictions.csv

clean:
	rm -rf $(VENV) runs
