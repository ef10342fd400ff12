"""Run by tests/test_cpu_kinds.py in a process whose CPU kind and thread count are imitated: embed
the bundled sample's logs and lines, and save the embeddings to the file named by argv[1]; with
argv[2], torch's thread count is set to it first (a switch after start)."""

import sys
from pathlib import Path

import numpy as np

import qcg_gpu  # noqa: F401  (sets MKL's reproducible mode before the first GEMM)
from qcg_gpu.embedding import Embedder

SAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lihuaworld_sample" / "docs"


def main() -> None:
    logs = [p.read_text() for p in sorted(SAMPLE.rglob("*.txt"))]
    texts = logs + [line for log in logs for line in log.splitlines() if line.strip()][:38]  # 2 padded lengths
    embedder = Embedder(device="cpu")
    if len(sys.argv) > 2:
        import torch

        torch.set_num_threads(int(sys.argv[2]))
    np.save(sys.argv[1], embedder.encode(texts))


if __name__ == "__main__":
    main()
