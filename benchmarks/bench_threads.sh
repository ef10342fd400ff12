#!/usr/bin/env bash
# vLLM's CPU thread binding, with and without a competing process (issue 17 §6): Doc2Query output
# tok/s of the engine's generation and of the bare engine (qcg bench --parts doc2query), for
# VLLM_CPU_OMP_THREADS_BIND=auto (vLLM pins one OpenMP thread per core, its default) and nobind
# (the OS places the threads), each alone and beside one busy Python process.
#
#   benchmarks/bench_threads.sh            # DOCS (default: the bundled sample), LIMIT chunks (24), M pairs (20)
set -euo pipefail
cd "$(dirname "$0")/.."
DOCS=${DOCS:-examples/lihuaworld_sample/docs}
LIMIT=${LIMIT:-24}
M=${M:-20}
OUT=benchmarks/out/threads
mkdir -p "$OUT"
for bind in auto nobind; do
    for competitor in idle busy; do
        busy=
        if [ "$competitor" = busy ]; then
            python -c "while True: pass" &
            busy=$!
        fi
        VLLM_CPU_OMP_THREADS_BIND=$bind python -m qcg_gpu.cli bench --parts doc2query --docs "$DOCS" \
            --limit "$LIMIT" --m "$M" --repeat 1 --json "$OUT/$bind-$competitor.json" > "$OUT/$bind-$competitor.log" 2>&1
        [ -n "$busy" ] && kill "$busy"
        python -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(sys.argv[2], sys.argv[3], \
'engine', r['engine_output_tok_per_s'], 'bare', r['bare_output_tok_per_s'], 'tok/s;', r['cpu'])" \
            "$OUT/$bind-$competitor.json" "$bind" "$competitor"
    done
done
