"""Expansion, node scoring, per-chunk mean and top-K on CPU, fused per query
(METHOD.md, retrieval steps 3-5).

Per query: Q* = seeds plus every node reachable in 1..h hops along the CSR
out-edges (each node once, found with a visit stamp instead of a set); the
similarity of each expanded node is a dot product against the query (a sampled
dense-dense product: only the entries of Q*); chunk scores are the mean over a
chunk's nodes in Q*; the K best chunks win, ties by lower chunk id.

Threads take queries round-robin and keep their scratch arrays (visit stamps,
chunk sums) across queries, so nothing of size N is cleared per query.
``rank_query`` is the per-query step; ``prefilter_cpu.rescore_and_rank`` (every precision, float32
included) calls it right after a query's seeds are rescored, and ``rescore_all_and_rank`` after a
row of near-ties is rescored over every node; ``expand_and_rank`` ranks from seeds chosen elsewhere
(the bench's library routes) and ``reached_nodes`` gives the trace view its Q*.
"""

from __future__ import annotations

import numba
import numpy as np

from .prefetch_cpu import prefetch_row
from .structs import Scratch

PREFETCH_DISTANCE = 2  # rows ahead: a row loads while the one before it is summed


@numba.njit(inline="always")
def new_scratch(n_nodes, n_chunks):
    """One thread's :class:`Scratch` for ``rank_query``, kept across its queries."""
    return Scratch(
        np.zeros(n_nodes, dtype=np.int32),
        np.zeros(n_chunks, dtype=np.int32),
        np.zeros(n_chunks, dtype=np.float64),
        np.zeros(n_chunks, dtype=np.int64),
        np.empty(n_nodes, dtype=np.int64),
        np.empty(n_chunks, dtype=np.int64),
    )


@numba.njit(inline="always")
def expand(mark, seeds, graph, hops, stamp, selected):
    """Q* into ``selected`` in breadth-first order: the seeds (ids < 0 skipped), then each hop's new
    nodes in the order they are found along ``graph``'s out-edges. Returns |Q*|; ``stamp[u] == mark``
    marks a visited node."""
    indptr, indices = graph.indptr, graph.indices
    size = 0
    for s in range(len(seeds)):
        u = seeds[s]
        if u >= 0 and stamp[u] != mark:
            stamp[u] = mark
            selected[size] = u
            size += 1
    start, end = 0, size
    for _ in range(hops):  # breadth-first, one hop per round
        for i in range(start, end):
            u = selected[i]
            for e in range(indptr[u], indptr[u + 1]):
                v = indices[e]
                if stamp[v] != mark:
                    stamp[v] = mark
                    selected[size] = v
                    size += 1
        start, end = end, size
    return size


@numba.njit(inline="always")
def rank_query(mark, seeds, query, nodes, graph, hops, scratch, out):
    """One query: Q* = its seeds (ids < 0 skipped) and h hops, each node's similarity, the chunk means and
    the K best chunks into ``out`` = (chunk ids, scores) (K = their length, pre-filled with -1/-inf).
    Returns |Q*|. ``mark`` must differ between the queries one ``scratch`` serves (stamp == mark: visited)."""
    chunks_out, scores_out = out
    stamp, chunk_stamp, chunk_sum, chunk_count = (
        scratch.stamp,
        scratch.chunk_stamp,
        scratch.chunk_sum,
        scratch.chunk_count,
    )
    selected, touched, node_chunk = scratch.selected, scratch.touched, graph.node_chunk
    size = expand(mark, seeds, graph, hops, stamp, selected)
    n_touched = 0
    for i in range(min(PREFETCH_DISTANCE, size)):
        prefetch_row(nodes, selected[i])
    for i in range(size):
        u = selected[i]
        if i + PREFETCH_DISTANCE < size:
            prefetch_row(nodes, selected[i + PREFETCH_DISTANCE])  # loads while this row is summed
        sim = np.float32(0.0)
        for d in range(nodes.shape[1]):
            sim += query[d] * nodes[u, d]
        c = node_chunk[u]
        if chunk_stamp[c] != mark:
            chunk_stamp[c] = mark
            chunk_sum[c] = 0.0
            chunk_count[c] = 0
            touched[n_touched] = c
            n_touched += 1
        chunk_sum[c] += sim
        chunk_count[c] += 1
    top_k = len(chunks_out)
    for i in range(n_touched):  # insertion into the sorted top-K buffer
        c = touched[i]
        score = np.float32(chunk_sum[c] / chunk_count[c])
        pos = top_k
        while pos > 0 and (score > scores_out[pos - 1] or (score == scores_out[pos - 1] and c < chunks_out[pos - 1])):
            pos -= 1  # ranked by (score desc, chunk id asc)
        if pos < top_k:
            for j in range(top_k - 1, pos, -1):
                scores_out[j] = scores_out[j - 1]
                chunks_out[j] = chunks_out[j - 1]
            scores_out[pos] = score
            chunks_out[pos] = c
    return size


# reassoc lets LLVM vectorise the dot products (a different summation order: results move in
# the last float32 bits, as they do between any two BLAS builds).
@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def expand_and_rank(seed_ids, queries, nodes, graph, ranking):
    """``rank_query`` for every row of ``seed_ids`` (-1 padded), seeds chosen elsewhere, as ``ranking``
    (a :class:`Ranking`) says; threads take queries round-robin."""
    n_queries, top_k, n_threads = seed_ids.shape[0], ranking.top_k, ranking.n_threads
    out_chunks = np.full((n_queries, top_k), -1, dtype=np.int64)
    out_scores = np.full((n_queries, top_k), -np.inf, dtype=np.float32)
    out_selected = np.zeros(n_queries, dtype=np.int64)
    for t in numba.prange(n_threads):
        scratch = new_scratch(nodes.shape[0], graph.n_chunks)
        for b in range(t, n_queries, n_threads):
            out = (out_chunks[b], out_scores[b])
            out_selected[b] = rank_query(
                np.int32(b + 1), seed_ids[b], queries[b], nodes, graph, ranking.hops, scratch, out
            )
    return out_chunks, out_scores, out_selected


@numba.njit(cache=True)
def reached_nodes(seeds, graph, n_nodes, hops):
    """Q* of one query in breadth-first order (``expand``), and its size after 0, 1, ..., h hops (the
    walk to h hops begins with the walk to fewer), for the trace view."""
    selected, stamp = np.empty(n_nodes, dtype=np.int64), np.zeros(n_nodes, dtype=np.int32)
    sizes = np.empty(hops + 1, dtype=np.int64)
    for h in range(hops + 1):
        sizes[h] = expand(np.int32(h + 1), seeds, graph, h, stamp, selected)
    return selected[: sizes[hops]], sizes
