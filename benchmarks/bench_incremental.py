"""Incremental kNN updates vs a full rebuild of the graph, on one synthetic index, in one run.

Adds (then removes) a batch of nodes to an N-node kNN graph with qcg_gpu.indexing.knn.add_nodes /
remove_nodes and times a full knn_graph over the same nodes side by side; the results are
checked equal in the same run. The graph is what grows with N (generation and embedding
cost is per new chunk either way), so synthetic vectors stand in for pairs.

    python benchmarks/bench_incremental.py                      # N = 100k, 1k and 10k nodes added
    python benchmarks/bench_incremental.py --nodes 20000 --added 500
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from qcg_gpu.capabilities import cpu_kind
from qcg_gpu.indexing.knn import add_nodes, knn_graph, remove_nodes

DIM = 384


def clustered(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((max(n // 64, 1), DIM)).astype(np.float32)
    x = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.standard_normal((n, DIM), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def same(a, b) -> bool:
    return (
        np.array_equal(a.indptr, b.indptr)
        and np.array_equal(a.indices, b.indices)
        and np.array_equal(a.scores, b.scores)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100_000, help="nodes in the index before the update")
    parser.add_argument("--added", type=int, nargs="+", default=[1000, 10_000], help="nodes added (then removed again)")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--backend", default="auto", help="kNN search backend: faiss, torch or auto")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "bench_incremental.json")
    args = parser.parse_args()

    print(f"machine: {cpu_kind()} ({platform.machine()})")
    rows = []
    for added in args.added:
        x = clustered(args.nodes + added)
        old = x[: args.nodes]
        base = knn_graph(old, args.k, args.backend)
        grown, add_s = timed(add_nodes, base, old, x[args.nodes :], args.k, args.backend)
        full, full_s = timed(knn_graph, x, args.k, args.backend)
        keep = np.ones(len(x), bool)
        keep[np.random.default_rng(1).choice(len(x), added, replace=False)] = False  # remove as many, spread out
        shrunk, remove_s = timed(remove_nodes, full, x, keep, args.k, args.backend)
        rebuilt, rebuild_s = timed(knn_graph, x[keep], args.k, args.backend)
        row = {
            "nodes": args.nodes,
            "added_or_removed": added,
            "k": args.k,
            "backend": args.backend,
            "add_s": round(add_s, 2),
            "full_build_s": round(full_s, 2),
            "add_speedup": round(full_s / add_s, 1),
            "add_equals_rebuild": same(grown, full),
            "remove_s": round(remove_s, 2),
            "rebuild_after_remove_s": round(rebuild_s, 2),
            "remove_speedup": round(rebuild_s / remove_s, 1),
            "remove_equals_rebuild": same(shrunk, rebuilt),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
