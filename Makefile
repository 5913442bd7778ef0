VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test test-fast demo

setup:
	bash scripts/setup_cpu_env.sh

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	bash examples/pretrain_gpt/demo_cpu.sh
