#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment for a CPU-only machine.
#
# torch is pinned to 2.13.0, the CPU wheel on these machines' disk: an unpinned torch would pull
# a multi-GB CUDA build. megatron-core 0.19.2 declares Requires-Python >= 3.12 but its wheel runs
# on 3.11, so it goes in with --no-deps --ignore-requires-python after its light dependencies;
# `pip install -e .` then finds it already satisfied.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
STAMP="$VENV/.hdet-setup-stamp"
WANT=$(cat pyproject.toml scripts/setup_cpu_env.sh | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi
echo "[setup] installing torch==2.13.0 (CPU), megatron-core==0.19.2 and hdet-megatron[dev]"
$PIP install -q "torch==2.13.0" numpy "packaging>=24.2" einops psutil
$PIP install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
$PIP install -q -e ".[dev]"
echo "$WANT" > "$STAMP"
