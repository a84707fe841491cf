# Two commands matter: `make demo` and `make test`. Each creates .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
LLMSCALE := $(VENV)/bin/llmscale
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: demo test lint results claims docs reliability clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt setuptools wheel
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e '.[dev]'
	touch $(STAMP)

# The demo trains on 4 CPU processes: FSDP over 2 ranks x tensor parallelism over 2 (docs/parallel.md).
demo: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 -m llmscale train --config configs/default.toml \
		--parallel.dp_shard 2 --parallel.tp 2 --overwrite
	$(LLMSCALE) plot runs/demo
	$(LLMSCALE) plan --model llama2-70b --gpu h200 --gpus 64 --seq 4096 --global-batch 1024 --top 5 \
		--png runs/demo/plan-llama2-70b-h200.png

test: $(STAMP)
	$(PY) -m pytest -q

# Measured vs predicted, every bench suite on this machine: docs/results.md and its plots.
results: $(STAMP)
	$(LLMSCALE) bench --what all --png docs/results --json-out docs/results/results.json \
		--markdown docs/results.md
	$(PY) -m llmscale.docs

# Every claim of the article, checked against the catalog, planner and results.json (no training).
claims: $(STAMP)
	$(LLMSCALE) claims --markdown docs/claims.md

# Every figure of README.md and docs/ that comes from a run, rendered from results.json, the
# planner and the commands' own renderers (llmscale/docs.py; measures nothing but the plan
# search's seconds; tests/test_docs.py fails on a stale block).
docs: $(STAMP)
	$(PY) -m llmscale.docs

# The fault-injection suite's rows (tests/faults, fault_row) as docs/reliability.md; the page is
# written even when a case fails (it shows which), and make then fails.
reliability: $(STAMP)
	rm -f build/reliability.json; status=0; \
	LLMSCALE_RELIABILITY_JSON=build/reliability.json $(PY) -m pytest tests/faults -q || status=$$?; \
	$(PY) -m llmscale.bench.reliability build/reliability.json docs/reliability.md && exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs build src/*.egg-info
