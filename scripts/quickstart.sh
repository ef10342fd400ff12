#!/usr/bin/env bash
# Install qcg-gpu, index the bundled LiHuaWorld sample with the bundled models, score a batch of
# questions by three methods, then answer one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SAMPLE=examples/lihuaworld_sample
scripts/install.sh
# M = 10 pairs per chunk (the paper's 20 is the default of `qcg index build`): half the generation, so the
# whole script runs in about 3.5 minutes on 2 idle cores once installed (benchmarks/RESULTS.md).
"$PY" -m qcg_gpu.cli index build "$SAMPLE/docs" out/lihuaworld_sample --overwrite --m 10 "$@"
# The batch job: the sample's questions retrieved by naive RAG, Doc2Query-- and QCG, scored against
# their evidence. gamma 1.0 (the paper's MultiHop-RAG value): the 135M model's pairs rarely reach
# cosine 0.5 to a question.
"$PY" -m qcg_gpu.cli eval --dataset lihuaworld --data "$SAMPLE" --index out/lihuaworld_sample \
    --methods naive,d2q-minus,qcg --no-answers --gamma 1.0 --out out/lihuaworld_sample_eval --quiet >/dev/null
"$PY" - out/lihuaworld_sample_eval <<'PY'
import csv, sys
out = sys.argv[1]
recall = {r["method"]: float(r["R@5"]) for r in csv.DictReader(open(f"{out}/summary.csv"))}
delta = {r["method"]: r for r in csv.DictReader(open(f"{out}/comparisons.csv")) if r["metric"] == "R@5"}
print(f"\nEvidence recall R@5 on the sample's questions ({out}/summary.md has every metric):")
print(f"{'method':<10} {'R@5':>6}   difference from naive, 95% paired interval")
for method, value in recall.items():
    d = delta.get(method)
    diff = f"{100 * float(d['delta']):+.1f} [{100 * float(d['ci_low']):+.1f}, {100 * float(d['ci_high']):+.1f}]" if d else ""
    print(f"{method:<10} {100 * value:>6.1f}   {diff}")
PY
echo
echo "The bundled 135M model is there to run the engine, not to show the method: its pairs are weak"
echo "(docs/models.md names the larger ones). One question answered from QCG's top chunks:"
"$PY" -m qcg_gpu.cli answer out/lihuaworld_sample --query "What house rule does Adam mention?" --gamma 1.0 \
    --max-answer-tokens 64 --quiet
