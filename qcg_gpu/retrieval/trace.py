"""The paper's case-study view of one query (``qcg query --trace``), from the CPU backend's own
expansion and chunk scoring (``numpy_backend.rank_from_seeds``)."""

from __future__ import annotations

import numpy as np

from ..kernels.structs import Graph
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
    graph: Graph | None = None,
) -> dict:
    """Seeds, the nodes each hop added (in the order found) with their similarity to the query, and
    every reached chunk's score and the nodes it is the mean of, best first (ties by lower chunk id).
    ``graph``: ``compact_graph(index)``, if made."""
    graph = graph if graph is not None else compact_graph(index)
    seeds = seed_ids[seed_ids >= 0]
    reached, sizes = reached_nodes(index, seeds, hops, graph)
    members: dict[int, list[int]] = {}  # chunk -> its nodes in Q*
    for u in reached.tolist():
        members.setdefault(int(index.node_chunk[u]), []).append(u)
    # rank every reached chunk, and no more: each insertion into the top-K buffer costs O(K)
    chunk_ids, scores, _ = rank_from_seeds(index, query[None], seed_ids[None], hops, max(len(members), 1), graph)
    found = chunk_ids[0] >= 0
    expanded = reached[len(seeds) :]
    sims = index.node_embeddings[expanded].astype(np.float64) @ query.astype(np.float64)
    return {
        "seeds": [{"node_id": int(u), "sim": float(s)} for u, s in zip(seeds, seed_sims[: len(seeds)])],
        "expanded": expanded.tolist(),
        "expanded_sims": [round(float(s), 6) for s in sims],
        "hop_sizes": np.diff(sizes).tolist(),
        "chunks": [
            {"chunk_id": int(c), "score": float(v), "n_nodes": len(members[int(c)]), "node_ids": members[int(c)]}
            for c, v in zip(chunk_ids[0][found], scores[0][found])
        ],
    }


def readable_traces(index: QCGIndex, traces: list[dict]) -> list[dict]:
    """Traces as a person reads them (``qcg eval``'s report.html, ``qcg query --trace --html``): seeds and
    each hop's nodes as [node id, similarity], the kNN edges by which each hop reached its nodes, every
    reached chunk with the nodes it is the mean of, and each node's chunk and text (its generated question
    and answer, for pair nodes)."""
    nodes = index.table("nodes")
    text, source = nodes.column("text").to_pylist(), nodes.column("source_index").to_pylist()
    sentences = index.manifest.get("settings", {}).get("nodes", {}).get("nodes") == "sentence"
    pairs = None if sentences else index.table("pairs")
    questions = pairs.column("question").to_pylist() if pairs is not None else None
    answers = pairs.column("answer").to_pylist() if pairs is not None else None
    indptr, indices = index.knn_indptr, index.knn_indices

    def node(u: int) -> dict:
        about = {"chunk": int(index.node_chunk[u]), "text": text[u]}
        if questions is not None and answers is not None:
            about.update(question=questions[source[u]], answer=answers[source[u]])
        return about

    readable = []
    for trace in traces:
        sims = {s["node_id"]: s["sim"] for s in trace["seeds"]} | dict(zip(trace["expanded"], trace["expanded_sims"]))
        levels, start = [[s["node_id"] for s in trace["seeds"]]], 0
        for size in trace["hop_sizes"]:
            levels.append(trace["expanded"][start : start + size])
            start += size
        edges = []  # u -> v where v is new in the hop after u's
        for here, there in zip(levels, levels[1:]):
            targets = set(there)
            edges += [[u, int(v)] for u in here for v in indices[indptr[u] : indptr[u + 1]] if int(v) in targets]
        readable.append(
            {
                "seeds": [[u, sims[u]] for u in levels[0]],
                "hops": [[[u, sims[u]] for u in level] for level in levels[1:]],
                "edges": edges,
                "chunks": [_chunk(c) for c in trace["chunks"]],
                "nodes": {u: node(u) for u in sims},
                "sims": sims,
            }
        )
    return readable


def _chunk(chunk: dict) -> dict:
    return {"chunk": chunk["chunk_id"], "score": chunk["score"], "nodes": chunk["node_ids"]}
