#!/usr/bin/env bash
# One prepared device check (docs/gpu.md): run from the repository root on a machine with one
# CUDA GPU. Makes a virtual environment (torch's CUDA build from PyPI, then this package with
# its test and hf extras), then runs scripts/gpu_check.py, which writes gpu_check.json and
# summary.txt under $OUT (or results/gpu_check/). Budget: 8 minutes in all.
# Without a GPU it says so and exits 0 at once; --cpu-dry-run runs the steps on CPU instead.
# GPU_CHECK_PYTHON=/path/to/python skips the environment and uses that interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" != "--cpu-dry-run" ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi not found); nothing checked"
    exit 0
fi
start=$SECONDS
py="${GPU_CHECK_PYTHON:-}"
if [[ -z "$py" ]]; then
    venv="${GPU_CHECK_VENV:-.venv-gpu}"
    if [[ ! -x "$venv/bin/python" ]]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip
        "$venv/bin/pip" install -q torch          # PyPI's Linux wheel is the CUDA build
        "$venv/bin/pip" install -q -e '.[test,hf]'
    fi
    py="$venv/bin/python"
fi
echo "gpu_check: environment ready after $((SECONDS - start)) s"
left=$((480 - (SECONDS - start)))
(( left > 60 )) || { echo "gpu_check: setup took $((SECONDS - start)) s; under 60 s left"; exit 1; }
exec timeout "$left" "$py" scripts/gpu_check.py "$@"
