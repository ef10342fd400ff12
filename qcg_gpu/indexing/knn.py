"""kNN graph of the nodes (METHOD.md, index step 4): E_intra as a CSR matrix.

Row i holds the ``k`` nearest *other* nodes of node i by inner product (the
embeddings are unit vectors, so this is cosine), best first, ties by lower
node id. Two steps:

1. candidates: the ``k + 1 + CANDIDATE_MARGIN`` best of each row (:mod:`ranking`), from faiss
   (GPU index when faiss sees a GPU) or a tiled torch matmul + topk (CUDA when
   present, which is also the GPU path without faiss-gpu);
2. exact ranking: the candidates are rescored in float64 (``kernels/pair_dots``), the same
   way whatever found them, and sorted by (score desc, id asc). A row whose k-th
   score ties the last candidate's is ranked against all nodes, so ties are
   broken by id even when the candidate cut fell inside a tie.

So faiss, torch CPU and torch CUDA give the same graph. :func:`add_nodes` and
:func:`remove_nodes` update a graph to the one a rebuild would give, searching only the rows
an update can change (incremental indexing).

Exact search is O(N^2). Past a million nodes on CPU, ``probes`` gives the approximate graph of
:mod:`ivf` instead (each node compared with the members of its ``probes`` nearest k-means lists,
scored with the same arithmetic). Updates of such a graph search their rows exactly, so the rows an
update touches become exact and the rest stay as built.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..index_format import IndexWriter, index_shards, load_shard_array
from ..log import progress_bar
from .ivf import ivf_graph
from .ranking import (
    best_in,
    best_over_shards,
    cross_scores,
    csr_of_rows,
    degree,
    merge_best,
    pair_scores,
    read_node_embeddings,
    search_candidates,
    search_width,
)

RERANK_TILE_ROWS = 2048


@dataclass
class KnnGraph:
    indptr: np.ndarray  # int64 (N + 1,)
    indices: np.ndarray  # int64 (nnz,), out-neighbours, best first
    scores: np.ndarray  # float32 (nnz,), cosine of each edge

    @property
    def k(self) -> int:
        return 0 if len(self.indptr) < 2 else int(self.indptr[1] - self.indptr[0])

    @classmethod
    def from_rows(cls, ids: np.ndarray, scores: np.ndarray) -> KnnGraph:
        """The graph whose row i is ``ids[i]`` (an (N, k) array) with ``scores[i]``."""
        n, k = ids.shape
        return cls(np.arange(n + 1, dtype=np.int64) * k, ids.reshape(-1), scores.reshape(-1))


def knn_graph(
    embeddings: np.ndarray, k: int, backend: str = "auto", device: str | None = None, probes: int | None = None
) -> KnnGraph:
    """kNN graph of unit-length ``embeddings`` (N, d); each row gets min(k, N - 1) edges. Exact,
    or with ``probes`` approximate: IVF candidates from that many lists per node, ranked exactly."""
    emb = np.ascontiguousarray(embeddings, dtype=np.float32)
    n = len(emb)
    k_eff = degree(k, n)
    if k_eff == 0:
        return KnnGraph.from_rows(np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
    if probes is not None:
        return KnnGraph.from_rows(*ivf_graph(emb, k_eff, probes, backend, device))
    candidates = search_candidates(emb, emb, search_width(k_eff, n), backend, device)
    return KnnGraph.from_rows(*rank_candidates(emb, candidates, k_eff))


def add_nodes(
    graph: KnnGraph, old: np.ndarray, new: np.ndarray, k: int, backend: str = "auto", device: str | None = None
) -> KnnGraph:
    """The kNN graph of ``old`` followed by ``new``, from the graph of ``old``, equal to
    ``knn_graph(concat(old, new), k)`` without the all-pairs search: the new rows are searched
    over every node; an old row is re-ranked only when a new node comes close enough to enter
    its k nearest (one old x new product decides)."""
    emb = np.ascontiguousarray(np.concatenate([old, new]), dtype=np.float32)
    n_old, n = len(old), len(old) + len(new)
    k_eff = degree(k, n)
    if len(new) == 0:
        return graph
    if graph.k != k_eff or n_old <= k_eff:  # old rows had fewer than k others: nothing to keep
        return knn_graph(emb, k, backend, device)
    edges = graph.indices.reshape(n_old, k_eff)
    width = search_width(k_eff, len(new))
    new_of_old = search_candidates(emb[:n_old], emb[n_old:], width, backend, device) + n_old
    # an old row changes when its best new candidate reaches its k-th edge (1e-5: float32 search error)
    best_new = pair_scores(emb, np.arange(n_old), new_of_old[:, 0])
    changed = np.flatnonzero(best_new >= graph.scores.reshape(n_old, k_eff)[:, -1] - 1e-5)
    ids = np.concatenate([edges, np.zeros((len(new), k_eff), np.int64)])
    scores = np.concatenate([graph.scores.reshape(n_old, k_eff), np.zeros((len(new), k_eff), np.float32)])
    if len(changed):
        candidates = np.concatenate([edges[changed], new_of_old[changed]], axis=1)
        ids[changed], scores[changed] = rank_candidates(emb, candidates, k_eff, rows=changed)
        if width < len(new):  # a tie with the last new candidate may continue past it: rank those rows fully
            weakest_new = (
                pair_scores(emb, np.repeat(changed, width), new_of_old[changed].reshape(-1))
                .reshape(-1, width)
                .min(axis=1)
            )
            for row in changed[scores[changed, -1] <= weakest_new.astype(np.float32)]:
                ids[row], scores[row] = _rank_row_fully(emb, row, k_eff)
    ids[n_old:], scores[n_old:] = exact_rows(emb, np.arange(n_old, n), k_eff, backend, device)
    return KnnGraph.from_rows(ids, scores)


def remove_nodes(
    graph: KnnGraph, emb: np.ndarray, keep: np.ndarray, k: int, backend: str = "auto", device: str | None = None
) -> KnnGraph:
    """The kNN graph of ``emb[keep]`` (ids renumbered in order), equal to ``knn_graph(emb[keep], k)``:
    only rows that lost an out-neighbour are searched again."""
    kept = np.ascontiguousarray(emb[keep], dtype=np.float32)
    n = len(kept)
    k_eff = degree(k, n)
    if graph.k != k_eff:
        return knn_graph(kept, k, backend, device)
    new_id = np.full(len(emb), -1, np.int64)
    new_id[keep] = np.arange(n)
    ids = new_id[graph.indices.reshape(len(emb), graph.k)[keep]]
    scores = graph.scores.reshape(len(emb), graph.k)[keep].copy()
    lost = np.flatnonzero((ids < 0).any(axis=1))
    if len(lost):
        ids[lost], scores[lost] = exact_rows(kept, lost, k_eff, backend, device)
    return KnnGraph.from_rows(ids, scores)


def exact_rows(
    emb: np.ndarray, rows: np.ndarray, k: int, backend: str = "auto", device: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of the exact kNN graph of ``emb`` (ids, scores): searched over every node, ranked exactly."""
    candidates = search_candidates(emb[rows], emb, search_width(k, len(emb)), backend, device)
    return rank_candidates(emb, candidates, k, rows=rows)


def _best_first(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Per row, the column order that sorts by score desc, then id asc."""
    by_id = np.argsort(ids, axis=1, kind="stable")
    by_score = np.argsort(-np.take_along_axis(scores, by_id, axis=1), axis=1, kind="stable")
    return np.take_along_axis(by_id, by_score, axis=1)


def rank_candidates(
    emb: np.ndarray, candidates: np.ndarray, k: int, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row's candidates (row ``rows[i]`` of ``emb``, default i) by exact score, ties by lower id."""
    n, width = len(emb), candidates.shape[1]
    row_ids = np.arange(len(candidates)) if rows is None else np.asarray(rows, np.int64)
    out_ids = np.empty((len(candidates), k), dtype=np.int64)
    out_scores = np.empty((len(candidates), k), dtype=np.float32)
    for start in progress_bar(
        range(0, len(candidates), RERANK_TILE_ROWS),
        desc="rank kNN edges",
        unit="tile",
        disable=len(candidates) <= RERANK_TILE_ROWS,
    ):
        cand = candidates[start : start + RERANK_TILE_ROWS]
        rows = row_ids[start : start + len(cand)]
        valid = (cand >= 0) & (cand != rows[:, None])  # faiss pads with -1; self is never a neighbour
        safe = np.where(valid, cand, 0)
        scores = pair_scores(emb, np.repeat(rows, width), safe.reshape(-1)).reshape(cand.shape)
        scores[~valid] = -np.inf
        order = _best_first(np.where(valid, cand, n), scores)
        ids = np.take_along_axis(cand, order, axis=1)
        ranked = np.take_along_axis(scores, order, axis=1)
        # A tie between the k-th and the last candidate may continue past the candidates: rank fully.
        weakest = np.where(valid, scores, np.inf).min(axis=1)
        unsure = (ranked[:, k - 1] <= weakest) & (width < n)
        for local in np.flatnonzero(unsure):
            ids[local, :k], ranked[local, :k] = _rank_row_fully(emb, rows[local], k)
        out_ids[start : start + len(cand)] = ids[:, :k]
        out_scores[start : start + len(cand)] = ranked[:, :k]
    return out_ids, out_scores


def _rank_row_fully(emb: np.ndarray, row: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    others = np.delete(np.arange(len(emb)), row)
    scores = pair_scores(emb, np.full(len(others), row), others)
    order = np.lexsort((others, -scores))[:k]
    return others[order], scores[order]


# ---- the exact graph of a sharded index, one shard's rows at a time --------------------------------


def shard_rows(data: str, layout: dict, shard: int, k: int, backend: str = "auto", device: str | None = None):
    """The exact kNN rows of node shard ``shard`` (its CSR: indptr from 0, global ids, float32 scores),
    its nodes compared with every shard's, one shard read from ``data`` at a time: the task holds two
    shards of embeddings at most. Equal to those rows of :func:`knn_graph` of every node."""
    shards = index_shards(layout)
    rows = read_node_embeddings(data, layout, shards[shard])
    k_eff = degree(k, shards[-1].nodes[1])
    ids, scores = best_over_shards(data, layout, rows, np.arange(*shards[shard].nodes), k_eff, backend, device, shard)
    return csr_of_rows(ids, scores)


def grown_shard_rows(data: str, layout: dict, shard: int, new: np.ndarray, backend: str = "auto", device=None):
    """Node shard ``shard``'s kNN rows (as :func:`shard_rows` gives them) once the nodes ``new`` are added
    after every shard of ``layout``: the rows :func:`add_nodes` gives (:func:`merge_new_nodes`). The task
    holds this shard and ``new``, not the other shards."""
    shards = index_shards(layout)
    own = shards[shard]
    rows = read_node_embeddings(data, layout, own)
    if len(rows) == 0:  # a shard of chunks without nodes
        return csr_of_rows(np.zeros((0, 0), np.int64), np.zeros((0, 0)))
    edges, stored = (load_shard_array(data, layout, own, name, verify=False) for name in ("knn_indices", "knn_scores"))
    edges, stored = np.array(edges).reshape(len(rows), -1), np.array(stored).reshape(len(rows), -1)
    first_new = shards[-1].nodes[1]
    best_new = best_in(rows, None, new, np.arange(first_new, first_new + len(new)), edges.shape[1], backend, device)
    merge_new_nodes(data, layout, rows, (edges, stored), best_new)
    return csr_of_rows(edges, stored)


def merge_new_nodes(data: str, layout: dict, rows: np.ndarray, graph_rows: tuple, best_new: tuple) -> None:
    """Merge into the kNN rows ``graph_rows`` (edges: node ids of ``layout``, the index at ``data``; their
    stored scores), in place, each row's k best new nodes ``best_new`` (ids above every edge's, exact scores:
    :func:`ranking.best_in`), as :func:`add_nodes` does. A row changes only where its best new node reaches
    its k-th edge; it then keeps the k best of its edges, rescored exactly (:func:`edge_scores`), and those."""
    edges, stored = graph_rows
    new_ids, new_scores = best_new
    # A new node has a higher id than every edge, so it enters a row only above the k-th edge's exact score,
    # which the stored float32 one is within 1e-7 of.
    changed = np.flatnonzero(new_scores[:, 0] >= stored[:, -1] - 1e-6)
    if len(changed):
        exact = edge_scores(data, layout, rows[changed], edges[changed])
        k = edges.shape[1]
        edges[changed], stored[changed] = merge_best(edges[changed], exact, new_ids[changed], new_scores[changed], k)


def edge_scores(data: str, layout: dict, rows: np.ndarray, neighbors: np.ndarray) -> np.ndarray:
    """The exact (float64) score of each row with each of its ``neighbors`` (node ids), as ranking gives
    it: only the neighbours' rows are read from each shard's memory map, one shard at a time."""
    out = np.empty(neighbors.shape)
    for shard in index_shards(layout):
        lo, hi = shard.nodes
        at_row, at_col = np.nonzero((neighbors >= lo) & (neighbors < hi))
        if len(at_row):
            wanted, where = np.unique(neighbors[at_row, at_col] - lo, return_inverse=True)
            base = load_shard_array(data, layout, shard, "node_embeddings", verify=False)[wanted]
            out[at_row, at_col] = cross_scores(rows, base.astype(np.float32), at_row, where)
    return out


def grow_shards(writer: IndexWriter, data: Path, manifest: dict, new: np.ndarray, config) -> None:
    """The kNN rows of a sharded index (``manifest``'s, files at ``data``) that the nodes ``new`` were added
    to as new shards, written shard by shard to ``writer`` (the new version, the old shards' embeddings
    kept in it): each old shard's rows grown (:func:`grown_shard_rows`), then each new shard's rows
    searched over every shard (:func:`shard_rows`). The graph equals :func:`add_nodes`'."""
    assert writer.shards is not None
    old = {"shards": manifest["shards"]}
    backend, device, new = config.graph.knn_backend, config.nodes.device, np.asarray(new, np.float32)
    layout = {"shards": [s.to_dict() for s in writer.shards]}
    shards = range(len(writer.shards))
    for shard in progress_bar(shards, desc="kNN shards", unit="shard", disable=len(shards) < 2):
        if shard < len(old["shards"]):
            rows = grown_shard_rows(str(data), old, shard, new, backend, device)
        else:
            rows = shard_rows(str(writer.data), layout, shard, config.graph.knn_k, backend, device)
        writer.write_shard_graph(shard, *rows)
