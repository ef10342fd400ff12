"""How much of retrieval's GEMM could an exact bound skip (issue 18)? Two bounds, on real and
synthetic nodes, against the paper's seed threshold (sim >= 0.5, gamma 1.5) and against an
oracle threshold (each query's own n-th best similarity, the tightest any top-n search can use):

- block cones: nodes grouped by k-means into blocks of ~64; a block whose cone (centre direction,
  widest member angle) cannot reach the threshold is skipped whole;
- low-rank + tail: u.x <= u_r.x_r + |u_tail| |x_tail| after a PCA rotation, r of 384 dimensions
  computed (a GEMM r/384 the size), the nodes whose bound reaches the threshold rescored.

A bound pays only if it skips most of the work: to make retrieval 3x faster it must skip > 2/3
of the GEMM, and the rescoring of what it keeps costs more per node than the GEMM did.

    python benchmarks/bench_pruning.py [--index INDEX] [--nodes 100000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from qcg_gpu.capabilities import cpu_kind, require
from qcg_gpu.eval.bench import synthetic_index, synthetic_queries
from qcg_gpu.eval.datasets import load_dataset
from qcg_gpu.retrieval import QCGIndex

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lihuaworld"


def oracle_threshold(nodes: np.ndarray, queries: np.ndarray, n: int, floor: float) -> np.ndarray:
    sims = queries @ nodes.T
    return np.maximum(np.sort(sims, axis=1)[:, -n], floor)


def cone_skipped(nodes: np.ndarray, queries: np.ndarray, threshold: np.ndarray, per_block: int = 64) -> float:
    """Share of node x query work skipped by block cones."""
    faiss = require("faiss")
    blocks = max(len(nodes) // per_block, 1)
    kmeans = faiss.Kmeans(nodes.shape[1], blocks, niter=10, seed=0, spherical=True)
    kmeans.train(nodes)
    assign = kmeans.index.search(nodes, 1)[1][:, 0]
    centre = kmeans.centroids / np.linalg.norm(kmeans.centroids, axis=1, keepdims=True)
    cos_member = np.einsum("ij,ij->i", nodes, centre[assign])
    half_angle = np.full(blocks, 0.0)
    np.maximum.at(half_angle, assign, np.arccos(np.clip(cos_member, -1, 1)))
    size = np.bincount(assign, minlength=blocks)
    angle = np.arccos(np.clip(queries @ centre.T, -1, 1))  # (B, blocks)
    reach = np.cos(np.maximum(angle - half_angle[None, :], 0.0))
    skipped = (reach < threshold[:, None]) * size[None, :]
    return float(skipped.sum() / (len(queries) * len(nodes)))


def tail_kept(nodes: np.ndarray, queries: np.ndarray, threshold: np.ndarray, rank: int) -> float:
    """Share of nodes whose low-rank + tail bound reaches the threshold (to be rescored)."""
    mean_free = nodes - nodes.mean(axis=0)
    _, _, vt = np.linalg.svd(mean_free[:: max(len(nodes) // 20000, 1)], full_matrices=False)
    x, u = nodes @ vt.T, queries @ vt.T  # an orthogonal rotation: inner products unchanged
    x_tail, u_tail = np.linalg.norm(x[:, rank:], axis=1), np.linalg.norm(u[:, rank:], axis=1)
    kept = 0
    for start in range(0, len(u), 256):
        bound = u[start : start + 256, :rank] @ x[:, :rank].T + np.outer(u_tail[start : start + 256], x_tail)
        kept += int((bound >= threshold[start : start + 256, None]).sum())
    return kept / (len(u) * len(x))


def measure(name: str, nodes: np.ndarray, queries: np.ndarray, n: int = 10, floor: float = 0.5) -> list[dict]:
    rows = []
    for label, threshold in (
        ("sim >= 0.5", np.full(len(queries), floor)),
        ("oracle n-th best", oracle_threshold(nodes, queries, n, floor)),
    ):
        row = {"nodes": name, "N": len(nodes), "queries": len(queries), "threshold": label}
        row["cone_blocks_skipped"] = round(cone_skipped(nodes, queries, threshold), 4)
        for rank in (32, 64, 96, 128):
            row[f"rank{rank}_tail_kept"] = round(tail_kept(nodes, queries, threshold, rank), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, help="a built index: its nodes, with the LiHuaWorld dev questions")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--nodes", type=int, default=100_000, help="synthetic index size")
    args = parser.parse_args()
    print(cpu_kind())
    synthetic = synthetic_index(args.nodes)
    measure("synthetic", synthetic.node_embeddings, synthetic_queries(synthetic, 1000))
    if args.index:
        index = QCGIndex.load(args.index)
        questions = [q.question for q in load_dataset("lihuaworld", args.data).questions]
        queries = index.embedder().encode(questions, "questions")
        measure("LiHuaWorld nodes", np.asarray(index.node_embeddings, np.float32), queries)


if __name__ == "__main__":
    main()
