# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# CI (.ci/run) also runs `make lint` and `make typecheck` (mypy, configured in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,train]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/proxima demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) bench/grpo_vs_trl.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
