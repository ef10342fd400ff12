"""kNN graph of the nodes (METHOD.md, index step 4): E_intra as a CSR matrix.

Row i holds the ``k`` nearest *other* nodes of node i by inner product (the
embeddings are unit vectors, so this is cosine), best first, ties by lower
node id. Two steps:

1. candidates: the ``k + 1 + CANDIDATE_MARGIN`` best of each row, from faiss
   (GPU index when faiss sees a GPU) or a tiled torch matmul + topk (CUDA when
   present, which is also the GPU path without faiss-gpu);
2. exact ranking: the candidates are rescored in float64 here, the same way
   whatever found them, and sorted by (score desc, id asc). A row whose k-th
   score ties the last candidate's is ranked against all nodes, so ties are
   broken by id even when the candidate cut fell inside a tie.

So faiss, torch CPU and torch CUDA give the same graph. :func:`add_nodes` and
:func:`remove_nodes` update a graph to the one a rebuild would give, searching only the rows
an update can change (incremental indexing).

Exact search is O(N^2). Past a million nodes on CPU, ``probes`` swaps step 1 for a faiss IVF
search (:func:`ivf_candidates`: each node compared with the nodes of its ``probes`` nearest
k-means lists only): step 2 still ranks what it finds exactly, but a true neighbour it misses is
missed (edge recall: ``qcg bench --parts knn``). Updates of such a graph
search their rows exactly, so the rows an update touches become exact and the rest stay as built.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..capabilities import WITH_FAISS, default_device, faiss_gpus, ieee_float32_matmul, require
from ..errors import QCGError
from ..log import progress_bar

CANDIDATE_MARGIN = 8
IVF_TRAIN_PER_LIST = 39  # faiss' minimum of training points per k-means centroid
RERANK_TILE_ROWS = 2048
SIMILARITY_TILE_ELEMENTS = 1 << 28  # 1 GiB of float32 similarities per tile


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


def degree(k: int, n: int) -> int:
    """Edges per row: k, or every other node when there are fewer."""
    return min(k, n - 1) if n > 1 else 0


def search_width(k: int, n: int) -> int:
    """Candidates searched per row: k + self + a margin for the float32 search's order errors."""
    return min(n, k + 1 + CANDIDATE_MARGIN)


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
    if probes is None:
        candidates = search_candidates(emb, emb, search_width(k_eff, n), backend, device)
    else:
        candidates = ivf_candidates(emb, search_width(k_eff, n), probes)
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
    ids = new_id[graph.indices.reshape(len(emb), -1)[keep]]
    scores = graph.scores.reshape(len(emb), -1)[keep].copy()
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


def search_candidates(
    queries: np.ndarray, base: np.ndarray, width: int, backend: str = "auto", device: str | None = None
) -> np.ndarray:
    """The ``width`` nodes of ``base`` most similar to each query, by a float32 search (ranked exactly later)."""
    if backend == "auto":
        backend = "faiss" if WITH_FAISS else "torch"
    if backend == "faiss":
        return faiss_candidates(queries, base, width)
    if backend == "torch":
        return torch_candidates(queries, base, width, device or default_device())
    raise QCGError(f"unknown kNN backend {backend!r} (choose faiss, torch or auto)")


def faiss_candidates(queries: np.ndarray, base: np.ndarray, width: int) -> np.ndarray:
    faiss = require("faiss")
    index = faiss.IndexFlatIP(base.shape[1])
    if faiss_gpus() > 0:
        index = faiss.index_cpu_to_all_gpus(index)
    index.add(np.ascontiguousarray(base))
    _, ids = index.search(np.ascontiguousarray(queries), width)
    return ids.astype(np.int64)


def ivf_candidates(emb: np.ndarray, width: int, probes: int) -> np.ndarray:
    """The ``width`` nodes nearest to each node among those of its ``probes`` nearest inverted lists
    (a faiss IVF-Flat index: ~4 sqrt(N) lists, k-means on a fixed sample); -1 where fewer are found."""
    faiss = require("faiss")
    n, dim = emb.shape
    lists = int(max(1, min(4 * np.sqrt(n), n // IVF_TRAIN_PER_LIST)))
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    sample = np.random.default_rng(0).choice(n, min(n, lists * 64), replace=False)
    index.train(emb[np.sort(sample)])
    index.nprobe = min(probes, lists)
    ids = np.empty((n, width), np.int64)
    block = 65536
    with progress_bar(total=2 * n, desc="IVF kNN", unit="node", disable=n <= block) as bar:
        for start in range(0, n, block):  # in blocks: the bar moves during a long build
            index.add(emb[start : start + block])
            bar.update(min(block, n - start))
        for start in range(0, n, block):
            ids[start : start + block] = index.search(emb[start : start + block], width)[1]
            bar.update(min(block, n - start))
    return ids


def torch_candidates(queries: np.ndarray, base: np.ndarray, width: int, device: str) -> np.ndarray:
    torch = require("torch")
    x, q = (
        torch.from_numpy(np.ascontiguousarray(base)).to(device),
        torch.from_numpy(np.ascontiguousarray(queries)).to(device),
    )
    rows = max(1, min(4096, SIMILARITY_TILE_ELEMENTS // max(len(base), 1)))
    out = []
    with torch.inference_mode(), ieee_float32_matmul():  # TF32 would blur the candidates the exact ranking gets
        for start in progress_bar(range(0, len(q), rows), desc="kNN search", unit="tile", disable=len(q) <= rows):
            sims = q[start : start + rows] @ x.T
            out.append(sims.topk(width, dim=1).indices.cpu())
    return torch.cat(out).numpy().astype(np.int64)


def pair_scores(emb: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float64 inner products emb[rows[i]] . emb[cols[i]], computed one way for every caller."""
    return np.einsum("ij,ij->i", emb[rows].astype(np.float64), emb[cols].astype(np.float64))


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
    shards of embeddings at most. Equal to those rows of :func:`knn_graph` of every node: each shard
    gives its k best by exact score (:func:`_best_in`), and the merge keeps the k best of those."""
    from ..index_format import index_shards, read_shard_rows

    shards = index_shards(layout)
    mine = shards[shard]
    rows = read_shard_rows(data, layout, [mine], "node_embeddings", verify=False).astype(np.float32, copy=False)
    row_ids = np.arange(*mine.nodes, dtype=np.int64)
    n = shards[-1].nodes[1]
    k_eff = degree(k, n)
    ids = np.full((len(rows), k_eff), n, np.int64)
    scores = np.full((len(rows), k_eff), -np.inf)
    for other in shards:
        base = rows if other is mine else read_shard_rows(data, layout, [other], "node_embeddings", verify=False)
        found, found_scores = _best_in(
            rows, row_ids, np.asarray(base, np.float32), other.nodes[0], k_eff, backend, device
        )
        ids, scores = _merge_best(ids, scores, found, found_scores, k_eff)
    return np.arange(len(rows) + 1, dtype=np.int64) * k_eff, ids.reshape(-1), scores.astype(np.float32).reshape(-1)


def _best_in(rows, row_ids, base, first: int, k: int, backend: str, device: str | None):
    """Each row's k best nodes of ``base`` (ids from ``first``) but itself, by exact float64 score, ties
    by lower id: :func:`rank_candidates`'s rule over one block (candidates from a float32 search, a row
    whose k-th score ties its weakest candidate ranked over the whole block). Padded with id N, -inf."""
    width = min(len(base), k + 1 + CANDIDATE_MARGIN)
    local = search_candidates(rows, base, width, backend, device)
    cand = np.where(local >= 0, local + first, -1)
    valid = (local >= 0) & (cand != row_ids[:, None])
    scores = _cross_scores(rows, base, np.repeat(np.arange(len(rows)), width), np.where(valid, local, 0).reshape(-1))
    scores = np.where(valid, scores.reshape(cand.shape), -np.inf)
    weakest = np.where(valid, scores, np.inf).min(axis=1)
    pad = np.iinfo(np.int64).max
    order = np.lexsort((np.where(valid, cand, pad), -scores), axis=-1)
    cand, scores = np.take_along_axis(cand, order, 1), np.take_along_axis(scores, order, 1)
    kth = scores[:, min(k, width) - 1]
    for r in np.flatnonzero((kth <= weakest) & (width < len(base))):  # a tie may go on past the candidates
        all_scores = _cross_scores(rows, base, np.full(len(base), r), np.arange(len(base)))
        others = np.arange(first, first + len(base))
        keep = others != row_ids[r]
        best = np.lexsort((others[keep], -all_scores[keep]))[:width]
        cand[r], scores[r] = others[keep][best], all_scores[keep][best]
    cand = np.where(np.isfinite(scores), cand, pad)
    if width < k:
        extra = k - width
        cand = np.pad(cand, ((0, 0), (0, extra)), constant_values=pad)
        scores = np.pad(scores, ((0, 0), (0, extra)), constant_values=-np.inf)
    return cand[:, :k], scores[:, :k]


def _merge_best(ids, scores, more_ids, more_scores, k: int):
    """Per row, the k best of two ranked lists by (score desc, id asc)."""
    both_ids, both_scores = np.concatenate([ids, more_ids], 1), np.concatenate([scores, more_scores], 1)
    order = np.lexsort((both_ids, -both_scores), axis=-1)[:, :k]
    return np.take_along_axis(both_ids, order, 1), np.take_along_axis(both_scores, order, 1)


def _cross_scores(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float64 inner products a[rows[i]] . b[cols[i]], computed as :func:`pair_scores` computes them."""
    return np.einsum("ij,ij->i", a[rows].astype(np.float64), b[cols].astype(np.float64))
