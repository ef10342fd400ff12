"""The paper's case-study view of one query (``qcg query --trace``)."""

from __future__ import annotations

import numpy as np

from .index import QCGIndex


def trace_query(index: QCGIndex, query: np.ndarray, seed_ids: np.ndarray, seed_sims: np.ndarray, hops: int) -> dict:
    """Seeds, nodes added by expansion, and every reached chunk's score, in plain Python."""
    seeds = [int(u) for u in seed_ids if u >= 0]
    selected, frontier, added = set(seeds), set(seeds), []
    for _ in range(hops):
        frontier = {
            int(v) for u in frontier for v in index.knn_indices[index.knn_indptr[u] : index.knn_indptr[u + 1]]
        } - selected
        selected |= frontier
        added += sorted(frontier)
    nodes = np.array(sorted(selected), dtype=np.int64)
    sims = index.node_embeddings[nodes] @ query if len(nodes) else np.zeros(0)
    chunks: dict[int, list[float]] = {}
    for u, s in zip(nodes.tolist(), sims.tolist()):
        chunks.setdefault(int(index.node_chunk[u]), []).append(s)
    ranked = sorted(chunks.items(), key=lambda item: (-float(np.mean(item[1])), item[0]))
    return {
        "seeds": [{"node_id": u, "sim": float(s)} for u, s in zip(seeds, seed_sims.tolist())],
        "expanded": added,
        "chunks": [{"chunk_id": c, "score": float(np.mean(v)), "n_nodes": len(v)} for c, v in ranked],
    }
