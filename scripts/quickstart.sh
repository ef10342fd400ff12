#!/usr/bin/env bash
# Install qcg-gpu, index the bundled LiHuaWorld sample with the bundled models, then answer a question.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
scripts/install.sh
# M = 10 pairs per chunk (the paper's 20 is the default of `qcg index build`): half the generation, so the
# demo runs in about 4 minutes on 2 idle cores (measured in benchmarks/RESULTS.md).
"$PY" -m qcg_gpu.cli index build examples/lihuaworld_sample/docs out/lihuaworld_sample --overwrite --m 10 "$@"
# gamma 1.0 (the paper's MultiHop-RAG value): the bundled 135M model's pairs rarely reach cosine 0.5 to a question.
"$PY" -m qcg_gpu.cli answer out/lihuaworld_sample --query "What house rule does Adam mention?" --gamma 1.0 --trace \
    --max-answer-tokens 64
