"""A plain per-query reference of QCG retrieval (METHOD.md), written for tests only:
Python sets, one query at a time, no batching, no kernels."""

from __future__ import annotations

import numpy as np

from qcg_gpu.retrieval import seed_threshold


def reference_search(nodes, indptr, indices, node_chunk, query, gamma, n, hops, top_k):
    sims = nodes.astype(np.float64) @ query.astype(np.float64)
    threshold = float(seed_threshold(gamma))
    ranked = sorted((-sims[u], u) for u in range(len(nodes)) if sims[u] >= threshold)
    seeds = [u for _, u in ranked[:n]]
    selected, frontier = set(seeds), set(seeds)
    for _ in range(hops):
        frontier = {int(v) for u in frontier for v in indices[indptr[u] : indptr[u + 1]]} - selected
        selected |= frontier
    by_chunk: dict[int, list[float]] = {}
    for u in selected:
        by_chunk.setdefault(int(node_chunk[u]), []).append(sims[u])
    scores = sorted((-float(np.mean(v)), c) for c, v in by_chunk.items())[:top_k]
    return seeds, selected, [c for _, c in scores], [-s for s, _ in scores]
