#!/usr/bin/env bash
# GPU check for a lent device (one H200 here): parity tests of the torch backends and the Triton
# kernel on CUDA, the kernel timed against torch's gather + einsum, then the retrieval benchmark on
# the GPU. The device image has torch, numba and cupy, but no faiss, vLLM or model weights, so only
# the tests that need none of those run. Under 8 minutes.
#   run via the device tool:  bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
python -m pip install --quiet --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
python -m pip install --quiet pyarrow pytest >/dev/null 2>&1 || true
nvidia-smi -L | tee "$OUT/device.txt"
timeout 240 python -m pytest -q tests/test_retrieval.py tests/test_knn.py tests/test_kernels.py -k "not real_embeddings and not interpreter" 2>&1 | tail -15 | tee "$OUT/device_tests.txt"
timeout 60 python benchmarks/bench_kernels.py --device cuda 2>&1 | tail -3 | tee "$OUT/device_kernels.txt"
timeout 360 python benchmarks/bench_retrieval.py --device cuda --backends torch:off torch:off:topk torch:bf16 torch:bf16:topk --nodes 100000 1000000 --batch 1000 10000 --repeat 2 \
  --loop-queries 20 --out "$OUT/bench_retrieval_gpu.json" 2>&1 | tail -20 | tee "$OUT/device_bench.txt"
