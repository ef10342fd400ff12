"""The approximate kNN graph (``--knn approximate``, ``qcg_gpu/indexing/ivf.py``) against the library
route, side by side in one run: faiss's IndexIVFFlat (the same ~4 sqrt(N) lists trained on the same
sample, the same probes) finding k + 9 candidates a node, ranked exactly by ``knn.rank_candidates``.

One JSON line per N: both build times, their ratio, and each graph's edge recall against the exact
graph on --sample rows (searched exactly). Clustered synthetic unit vectors (``qcg bench``'s).

    python benchmarks/bench_ivf.py --nodes 100000 300000
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from qcg_gpu.capabilities import cpu_kind, require
from qcg_gpu.eval.bench import clustered_vectors, edge_recall
from qcg_gpu.indexing import ivf
from qcg_gpu.indexing.knn import exact_rows, knn_graph, rank_candidates
from qcg_gpu.indexing.ranking import search_width


def faiss_route(emb: np.ndarray, k: int, probes: int) -> np.ndarray:
    """faiss IndexIVFFlat candidates (its own float32 list assignment and scan), ranked exactly."""
    faiss = require("faiss")
    n, dim = emb.shape
    lists = ivf.list_count(n)
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    index.train(emb[ivf.training_rows(n)])
    index.nprobe = min(probes, lists)
    index.add(emb)
    candidates = index.search(emb, search_width(k, n))[1]
    return rank_candidates(emb, candidates, k)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--probes", type=int, default=16)
    parser.add_argument("--sample", type=int, default=2000, help="rows whose exact edges give the recall")
    parser.add_argument("--backend", default="auto", help="qcg's centroid search: auto (torch), torch or faiss")
    args = parser.parse_args()
    for n in args.nodes:
        rng = np.random.default_rng(0)
        emb = clustered_vectors(n, rng)
        rows = np.sort(rng.choice(n, min(args.sample, n), replace=False))
        want = exact_rows(emb, rows, args.k)[0]
        start = time.perf_counter()
        ours = knn_graph(emb, args.k, args.backend, probes=args.probes).indices.reshape(n, args.k)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        theirs = faiss_route(emb, args.k, args.probes)
        theirs_s = time.perf_counter() - start
        row = {"nodes": n, "k": args.k, "probes": args.probes, "backend": args.backend, "qcg_s": round(ours_s, 1)}
        row |= {"faiss_ivf_s": round(theirs_s, 1), "speedup": round(theirs_s / ours_s, 2)}
        row |= {"qcg_edge_recall": round(edge_recall(ours[rows], want), 4)}
        row |= {"faiss_ivf_edge_recall": round(edge_recall(theirs[rows], want), 4), "cpu": cpu_kind()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
