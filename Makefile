# Two commands matter: `make demo` and `make test`. Each creates .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
LLMSCALE := $(VENV)/bin/llmscale
STAMP := $(VENV)/.installed
PYTHON ?= python3

.PHONY: demo demo-record test test-timed lint results claims docs reliability clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt setuptools wheel
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e '.[dev]'
	touch $(STAMP)

# The demo trains on 4 CPU processes: FSDP over 2 ranks x tensor parallelism over 2 (docs/parallel.md),
# plots the run and plans Llama 2 70B on 64 H200s (the commands: src/llmscale/bench/demo.py, which
# prints each), then records the run and its wall time in the run folder, runs/demo/demo.json
# (untracked: make demo changes no file of the checkout).
demo: $(STAMP)
	$(PY) -m llmscale.bench.demo

# make demo, recorded as the project's record, docs/results/demo.json, and README's demo blocks
# rendered from it.
demo-record: $(STAMP)
	$(PY) -m llmscale.bench.demo --record
	$(PY) -m llmscale.docs --block demo-wall --block demo-fit --block demo-run

test: $(STAMP)
	$(PY) -m pytest -q

# make test, timed: its wall time goes to docs/results/timings.json and README's line about it.
test-timed: $(STAMP)
	$(PY) -m llmscale.bench.timed "make test" -- $(PY) -m pytest -q
	$(PY) -m llmscale.docs --block test-time

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

# The fault-injection suite's rows (tests/faults, fault_row), kept as docs/results/reliability.json
# and rendered as docs/reliability.md; the page is written even when a case fails (it shows
# which), and make then fails.
reliability: $(STAMP)
	rm -f build/reliability.json; status=0; \
	LLMSCALE_RELIABILITY_JSON=build/reliability.json $(PY) -m pytest tests/faults -q || status=$$?; \
	cp build/reliability.json docs/results/reliability.json && \
	$(PY) -m llmscale.bench.reliability docs/results/reliability.json docs/reliability.md && exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs build src/*.egg-info
