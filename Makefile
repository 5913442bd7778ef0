VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup lint format test test-fast demo

setup:
	bash scripts/setup_cpu_env.sh

# Lint, format check and type check (config in pyproject.toml); seconds with a warm cache.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Apply the formatter and ruff's safe fixes.
format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup lint
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	bash examples/pretrain_gpt/demo_cpu.sh
