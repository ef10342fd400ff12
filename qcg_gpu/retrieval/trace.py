"""The paper's case-study view of one query (``qcg query --trace``), from the CPU backend's own
expansion and chunk scoring (``numpy_backend.rank_from_seeds``)."""

from __future__ import annotations

import numpy as np

from .index import QCGIndex
from .numpy_backend import compact_graph, rank_from_seeds, reached_nodes
from .result import RetrievalResult


def trace_queries(index: QCGIndex, queries: np.ndarray, result: RetrievalResult, hops: int) -> list[dict]:
    """:func:`trace_query` of every query of a batch, the kernels' compact graph made once for all."""
    graph = compact_graph(index)
    return [
        trace_query(index, queries[b], result.seed_ids[b], result.seed_sims[b], hops, graph)
        for b in range(len(queries))
    ]


def trace_query(
    index: QCGIndex,
    query: np.ndarray,
    seed_ids: np.ndarray,
    seed_sims: np.ndarray,
    hops: int,
    graph: tuple | None = None,
) -> dict:
    """Seeds, the nodes each hop added (in the order found), and every reached chunk's score and
    node count, best first (ties by lower chunk id). ``graph``: ``compact_graph(index)``, if made."""
    graph = graph if graph is not None else compact_graph(index)
    seeds = seed_ids[seed_ids >= 0]
    reached = reached_nodes(index, seeds, hops, graph)
    chunks, counts = np.unique(index.node_chunk[reached], return_counts=True)
    nodes_per_chunk = dict(zip(chunks.tolist(), counts.tolist()))
    # rank every reached chunk, and no more: each insertion into the top-K buffer costs O(K)
    chunk_ids, scores, _ = rank_from_seeds(index, query[None], seed_ids[None], hops, max(len(chunks), 1), graph)
    found = chunk_ids[0] >= 0
    return {
        "seeds": [{"node_id": int(u), "sim": float(s)} for u, s in zip(seeds, seed_sims[: len(seeds)])],
        "expanded": reached[len(seeds) :].tolist(),
        "chunks": [
            {"chunk_id": int(c), "score": float(v), "n_nodes": nodes_per_chunk[int(c)]}
            for c, v in zip(chunk_ids[0][found], scores[0][found])
        ],
    }
