"""kNN graph build: exact against approximate (``--knn approximate``, faiss HNSW), edge recall and time.

On clustered synthetic vectors (``qcg_gpu.bench.clustered_vectors``: 384-d, clusters of ~64),
for each N: the approximate graph's build time and its edge recall, the share of the exact
graph's edges it holds, measured on a random sample of rows whose exact rows are searched over
all N nodes. The exact graph is built whole (and timed) only up to ``--exact-up-to`` nodes: it
is O(N^2), ~N^2 * 768 flops. The CPU's kind is printed with every figure.

    python benchmarks/bench_knn.py                                  # N = 100k and 1M, ef 64
    python benchmarks/bench_knn.py --nodes 1000000 --ef 32 64 128 --sample 2000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from bench_retrieval import machine_gflops

from qcg_gpu.bench import clustered_vectors, edge_recall, exact_rows
from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.knn import degree, knn_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--k", type=int, default=2, help="kNN degree (paper: 2 LiHuaWorld, 3 MultiHop-RAG)")
    parser.add_argument("--ef", type=int, nargs="+", default=[64], help="HNSW search breadths (--knn-ef)")
    parser.add_argument("--sample", type=int, default=2000, help="rows whose exact kNN measures edge recall")
    parser.add_argument("--exact-up-to", type=int, default=200_000, help="largest N whose exact graph is timed")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_knn.json")
    args = parser.parse_args()

    cpu, gflops = cpu_kind(), machine_gflops()
    print(f"machine: {cpu}, float32 GEMM {gflops:.0f} GFLOP/s", flush=True)
    results = []
    for n in args.nodes:
        rng = np.random.default_rng(0)
        emb = clustered_vectors(n, rng)
        k = degree(args.k, n)
        sample = np.sort(rng.choice(n, min(args.sample, n), replace=False))
        start = time.perf_counter()
        want = exact_rows(emb, sample, k)
        sample_seconds = time.perf_counter() - start
        exact_seconds = None
        if n <= args.exact_up_to:
            start = time.perf_counter()
            exact = knn_graph(emb, k)
            exact_seconds = time.perf_counter() - start
            assert (exact.indices.reshape(n, k)[sample] == want).all(), "sampled exact rows != exact graph"
        for ef in args.ef:
            start = time.perf_counter()
            approx = knn_graph(emb, k, ef_search=ef)
            seconds = time.perf_counter() - start
            row = {
                "nodes": n,
                "k": k,
                "ef": ef,
                "approximate_build_s": round(seconds, 1),
                "exact_build_s": None if exact_seconds is None else round(exact_seconds, 1),
                # N / len(sample) times the sampled rows: an estimate (a small batch of rows searches slower per row)
                "exact_build_s_from_sample": round(sample_seconds * n / len(sample), 1),
                "edge_recall": round(edge_recall(approx.indices.reshape(n, k)[sample], want), 4),
                "sample_rows": len(sample),
                "cpu": cpu,
                "machine_gflops": round(gflops, 1),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
