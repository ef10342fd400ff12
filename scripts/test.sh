#!/usr/bin/env bash
# Install qcg-gpu with its test dependencies, then run the whole test suite (real models, no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/install.sh test
"$PY" -m pytest -q "$@"
