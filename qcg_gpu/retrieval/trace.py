"""The paper's case-study view of one query (``qcg query --trace``), from the CPU backend's own
expansion and chunk scoring (``numpy_backend.rank_from_seeds``)."""

from __future__ import annotations

import numpy as np

from .index import QCGIndex
from .numpy_backend import rank_from_seeds, reached_nodes


def trace_query(index: QCGIndex, query: np.ndarray, seed_ids: np.ndarray, seed_sims: np.ndarray, hops: int) -> dict:
    """Seeds, the nodes each hop added (in the order found), and every reached chunk's score and
    node count, best first (ties by lower chunk id)."""
    seeds = seed_ids[seed_ids >= 0]
    reached = reached_nodes(index, seeds, hops)
    nodes_per_chunk = np.bincount(index.node_chunk[reached], minlength=index.n_chunks)
    reached_chunks = max(int(np.count_nonzero(nodes_per_chunk)), 1)  # rank them all, and no more (K costs)
    chunk_ids, scores, _ = rank_from_seeds(index, query[None], seed_ids[None], hops, reached_chunks)
    found = chunk_ids[0] >= 0
    return {
        "seeds": [{"node_id": int(u), "sim": float(s)} for u, s in zip(seeds, seed_sims[: len(seeds)])],
        "expanded": reached[len(seeds) :].tolist(),
        "chunks": [
            {"chunk_id": int(c), "score": float(v), "n_nodes": int(nodes_per_chunk[c])}
            for c, v in zip(chunk_ids[0][found], scores[0][found])
        ],
    }
