#!/usr/bin/env bash
# The LiHuaWorld evaluation of benchmarks/RESULTS.md, rerun in minutes from the committed generations.
#
#   benchmarks/lihuaworld/run.sh [retrieval|answers|all] [REPLIES.parquet ...]
#       (default: all, over every committed replies-*.parquet that covers the whole corpus)
#   benchmarks/lihuaworld/run.sh confirm SPLIT.json [REPLIES.parquet ...]
#       one setting chosen on dev (CONFIRM_OPTIONS, default "--gamma 1.0 --hops 0", the dev sweeps' best),
#       evaluated once against naive RAG on another split's questions (LiHuaWorld's format, in a folder
#       beside the corpus's docs/), retrieval only, into benchmarks/lihuaworld/NAME/confirm/: its
#       comparisons.csv says whether the dev gain holds. Keep that split for this one look: a setting
#       tuned on it is selected on it.
#
# For each generation NAME (replies-NAME.parquet):
# 1. Rebuilds the whole-corpus index from the stored replies: no LLM is loaded, only the embedder
#    runs (~2 min on 2 cores). The file records the model and settings it was made with, so no other
#    flag is needed; a second index embeds long texts truncated (the paper's setup) for comparison.
#    The generations were made once with
#      qcg index build $DATA/docs OUT --replies-out benchmarks/lihuaworld/replies-smollm2.parquet
#      VLLM_CPU_KVCACHE_SPACE=4 qcg index build $DATA/docs OUT --model qwen2.5-coder-1.5b --m 20 --top-p 1.0 \
#          --repetition-penalty 1.0 --compact-json --batch-chunks 64 \
#          --replies-out benchmarks/lihuaworld/replies-qwen2.5-coder-1.5b-partial.parquet
#      VLLM_CPU_KVCACHE_SPACE=4 qcg index build $DATA/docs OUT --model qwen2.5-coder-1.5b --m 10 --prompt quoted \
#          --top-p 1.0 --repetition-penalty 1.0 --compact-json --batch-chunks 64 \
#          --replies-out benchmarks/lihuaworld/replies-qwen2.5-coder-1.5b-quoted-partial.parquet
#    (each renamed without -partial once it covers every chunk).
#    A file named ...-partial.parquet is a generation still under way: resume it with the same
#    command plus --replies-in FILE (it generates only the chunks the file lacks).
# 2. retrieval: every method and node-text ablation, and the paper's four sweeps, scored by
#    retrieval metrics on the dev split (no LLM), into benchmarks/lihuaworld/NAME/retrieval/.
# 3. answers: the main methods answered and judged by ANSWER_MODEL (default qwen2.5-coder-1.5b:
#    `qcg models install qwen2.5-coder-1.5b` first) on a balanced part of the dev split (PER_TYPE
#    questions per type, default 22: every multi-hop and Null question), into
#    benchmarks/lihuaworld/NAME/answers/, and QCG alone at its best dev settings (gamma 1.0, h 0)
#    into .../answers-qcg-h0/. ~30 min a generation on 2 cores (each prompt holds ~6,000 tokens of
#    chunks), so every answer and judgement is kept as it comes in
#    benchmarks/lihuaworld/answers-NAME.parquet (commit it as you go): a rerun, on any machine,
#    asks only what the file lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${DATA:-../shared/data/lihuaworld}
OUT=${OUT:-benchmarks/out/lihuaworld}
WHAT=${1:-all}
shift || true
if [[ $WHAT == confirm ]]; then
    SPLIT=${1:?usage: run.sh confirm SPLIT.json [REPLIES.parquet ...]}
    shift
fi
GENERATIONS=("$@")
[ ${#GENERATIONS[@]} -gt 0 ] || GENERATIONS=(benchmarks/lihuaworld/replies-*.parquet)

for replies in "${GENERATIONS[@]}"; do
    name=$(basename "$replies" .parquet)
    name=${name#replies-}
    if [[ $name == *-partial ]]; then
        echo "skipping $replies: a generation still under way (see the header of this script to resume it)"
        continue
    fi
    work="$OUT/$name" results="benchmarks/lihuaworld/$name"
    mkdir -p "$work" "$results"
    if [ "$replies" -nt "$work/index-truncate/manifest.json" ]; then  # built before from this file: kept
        qcg index build "$DATA/docs" "$work/index" --overwrite --quiet --replies-in "$replies" \
            --cache "$work/replay-cache.sqlite"
        qcg index build "$DATA/docs" "$work/index-truncate" --overwrite --quiet --replies-in "$replies" \
            --cache "$work/replay-cache.sqlite" --long-texts truncate
    fi

    if [[ $WHAT == retrieval || $WHAT == all ]]; then
        /usr/bin/time -f "$name retrieval eval: %e s wall" qcg eval --dataset lihuaworld --data "$DATA" \
            --index "$work/index" --compare-index "truncate=$work/index-truncate" --out "$results/retrieval" \
            --no-answers --quiet --methods naive,d2q,d2q-minus,qcg,qcg-q,qcg-a,qcg-sentence --sweeps hops,knn,seeds,alpha
    fi
    if [[ $WHAT == confirm ]]; then
        # shellcheck disable=SC2086  # CONFIRM_OPTIONS holds several options
        qcg eval --dataset lihuaworld --data "$SPLIT" --index "$work/index" --out "$results/confirm" --no-answers \
            --quiet --methods naive,qcg ${CONFIRM_OPTIONS:---gamma 1.0 --hops 0}
    fi
    if [[ $WHAT == answers || $WHAT == all ]]; then
        answers="benchmarks/lihuaworld/answers-$name.parquet"
        VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} /usr/bin/time -f "$name answer eval: %e s wall" \
            qcg eval --dataset lihuaworld --data "$DATA" --index "$work/index" --out "$results/answers" \
            --methods naive,d2q-minus,qcg --model "${ANSWER_MODEL:-qwen2.5-coder-1.5b}" \
            --limit-per-type "${PER_TYPE:-22}" --answers-cache "$OUT/answer-cache.sqlite" \
            --answers-out "$answers" $([ -f "$answers" ] && echo --answers-in "$answers")
        # QCG with the retrieval settings that did best on dev (no expansion, the 10 best nodes as seeds)
        VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} qcg eval --dataset lihuaworld --data "$DATA" \
            --index "$work/index" --out "$results/answers-qcg-h0" --methods qcg --gamma 1.0 --hops 0 \
            --model "${ANSWER_MODEL:-qwen2.5-coder-1.5b}" --limit-per-type "${PER_TYPE:-22}" \
            --answers-cache "$OUT/answer-cache.sqlite" --answers-out "$answers" --answers-in "$answers" --quiet
    fi
done
