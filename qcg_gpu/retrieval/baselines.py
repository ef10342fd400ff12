"""Naive RAG baselines on the same index (METHOD.md, "Baselines"): top-K chunks by cosine of
the query to a chunk embedding, where the chunk text is the chunk itself (naive), the chunk
expanded with all its generated questions (D2Q), or with its alpha-filtered ones (D2Q--)."""

from __future__ import annotations

import numpy as np

from ..config import RetrievalConfig
from ..embedding import Embedder
from ..errors import QCGError
from .index import QCGIndex
from .result import RetrievalResult, tile_rows


def chunk_embeddings(index: QCGIndex, method: str, embedder: Embedder) -> np.ndarray:
    if method == "naive":
        return np.asarray(index.array("chunk_embeddings"), dtype=np.float32)
    if method not in ("d2q", "d2q-minus"):
        raise QCGError(f"unknown baseline {method!r} (choose from naive, d2q, d2q-minus)")
    pairs = index.table("pairs").to_pydict()
    if not pairs["chunk_id"]:
        raise QCGError(f"{method} needs generated pairs; this index has none (built with --nodes sentence?)")
    texts = index.chunk_texts()
    questions: list[list[str]] = [[] for _ in texts]
    for chunk_id, question, kept in zip(pairs["chunk_id"], pairs["question"], pairs["kept"]):
        if method == "d2q" or kept:
            questions[chunk_id].append(question)
    return embedder.encode([text + "\n" + "\n".join(qs) for text, qs in zip(texts, questions)])


def top_k_chunks(chunk_emb: np.ndarray, queries: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, K) chunk ids and cosines, best first, ties by lower id; -1 / -inf padded."""
    from ..kernels.seeds_cpu import top_n_above  # numba: imported when used

    ids = np.full((len(queries), top_k), -1, np.int64)
    scores = np.full((len(queries), top_k), -np.inf, np.float32)
    k = min(top_k, len(chunk_emb))
    rows = tile_rows(len(chunk_emb))
    for start in range(0, len(queries), rows):
        sims = queries[start : start + rows] @ chunk_emb.T
        tile_ids, tile_scores = top_n_above(sims, np.float32(-np.inf), k)
        ids[start : start + len(sims), :k], scores[start : start + len(sims), :k] = tile_ids, tile_scores
    return ids, scores


def baseline_search(
    index: QCGIndex, method: str, embedder: Embedder, queries: np.ndarray, config: RetrievalConfig
) -> RetrievalResult:
    """A baseline's top-K chunks, as a RetrievalResult (no seeds: these methods have no graph)."""
    result = RetrievalResult.empty(len(queries), config)
    result.chunk_ids, result.scores = top_k_chunks(chunk_embeddings(index, method, embedder), queries, config.top_k)
    return result
