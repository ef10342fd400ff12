#!/usr/bin/env bash
# Install qcg-gpu, then index the bundled LiHuaWorld sample with the bundled models.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/install.sh
"$PY" -m qcg_gpu.cli index examples/lihuaworld_sample/docs out/lihuaworld_sample --overwrite "$@"
