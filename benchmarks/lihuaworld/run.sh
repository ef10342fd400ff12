#!/usr/bin/env bash
# The LiHuaWorld evaluation of benchmarks/RESULTS.md, rerun in minutes from the committed generation.
#
#   benchmarks/lihuaworld/run.sh [retrieval|answers|all]      (default: all)
#
# 1. Rebuilds the whole-corpus index from replies-smollm2.parquet: no LLM is loaded, only the
#    embedder runs (~1 min on 2 cores). The replies were made once with the bundled SmolLM2:
#      qcg index $DATA/docs OUT --batch-chunks 32 --replies-out benchmarks/lihuaworld/replies-smollm2.parquet
# 2. retrieval: every method and node-text ablation, and the paper's four sweeps, scored by
#    retrieval metrics on the dev split (no LLM).
# 3. answers: the main methods answered and judged by the bundled SmolLM2 on a balanced part of
#    the dev split (20 questions per type); on a GPU with a real model drop --limit-per-type and
#    pass --model (and --judge-model).
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-../shared/data/lihuaworld}
OUT=${OUT:-benchmarks/out/lihuaworld}
WHAT=${1:-all}
mkdir -p "$OUT"

qcg index "$DATA/docs" "$OUT/index" --overwrite --quiet \
    --replies-in benchmarks/lihuaworld/replies-smollm2.parquet --cache "$OUT/replay-cache.sqlite"

if [[ $WHAT == retrieval || $WHAT == all ]]; then
    /usr/bin/time -f "retrieval eval: %e s wall" qcg eval --dataset lihuaworld --data "$DATA" --index "$OUT/index" \
        --out "$OUT/retrieval" --no-answers --quiet \
        --methods naive,d2q,d2q-minus,qcg,qcg-q,qcg-a,qcg-sentence --sweeps hops,knn,seeds,alpha
fi
if [[ $WHAT == answers || $WHAT == all ]]; then
    /usr/bin/time -f "answer eval: %e s wall" qcg eval --dataset lihuaworld --data "$DATA" --index "$OUT/index" \
        --out "$OUT/answers" --methods naive,d2q-minus,qcg --limit-per-type "${PER_TYPE:-20}" --quiet
fi
