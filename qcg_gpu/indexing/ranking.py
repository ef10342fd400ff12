"""Exact top-k of rows against a block of nodes, the piece every kNN path shares (METHOD.md, index
step 4): a float32 search for candidates (faiss, or torch on CPU or CUDA), float64 rescoring of each
candidate pair (``kernels/pair_dots``, summed the same way whatever the batch), and ranking by
(score desc, id asc); a row whose k-th score ties its weakest candidate is ranked over the whole block.
Blocks merge (:func:`merge_best`), so the k best over shards read one at a time
(:func:`best_over_shards`) equal the k best over every node.
"""

from __future__ import annotations

import numpy as np

from ..capabilities import WITH_FAISS, default_device, faiss_gpus, ieee_float32_matmul, require
from ..errors import QCGError
from ..index_format import index_shards, read_shard_rows
from ..kernels.pair_dots import pair_dots
from ..log import progress_bar
from ..retrieval.bounds import float32_roundoff

CANDIDATE_MARGIN = 8
PAD = np.iinfo(np.int64).max  # the id of a missing edge while rows are merged (score -inf)
SIMILARITY_TILE_ELEMENTS = 1 << 28  # 1 GiB of float32 similarities per tile
# Rows ranked against a block at a time: their candidate arrays (a few of rows x (k + 9) x 8 bytes) stay
# ~30 MB however large a shard is, so a shard task holds its rows and one other shard, and little more.
RANK_ROWS = 16384


def degree(k: int, n: int) -> int:
    """Edges per row: k, or every other node when there are fewer."""
    return min(k, n - 1) if n > 1 else 0


def search_width(k: int, n: int) -> int:
    """Candidates searched per row: k + self + a margin for the float32 search's order errors."""
    return min(n, k + 1 + CANDIDATE_MARGIN)


def search_candidates(
    queries: np.ndarray, base: np.ndarray, width: int, backend: str = "auto", device: str | None = None
) -> np.ndarray:
    """The ``width`` nodes of ``base`` most similar to each query, by a float32 search (ranked exactly later)."""
    return search(queries, base, width, backend, device)[0]


def search(queries: np.ndarray, base: np.ndarray, width: int, backend: str = "auto", device: str | None = None):
    """:func:`search_candidates` and their float32 similarities (ids -1 and similarity -inf past ``base``)."""
    if backend == "auto":
        backend = "faiss" if WITH_FAISS else "torch"
    if backend == "faiss":
        return faiss_candidates(queries, base, width)
    if backend == "torch":
        return torch_candidates(queries, base, width, device or default_device())
    raise QCGError(f"unknown kNN backend {backend!r} (choose faiss, torch or auto)")


def faiss_candidates(queries: np.ndarray, base: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    faiss = require("faiss")
    queries, base = np.ascontiguousarray(queries), np.ascontiguousarray(base)
    if faiss_gpus() > 0:
        index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(base.shape[1]))
        index.add(base)
        sims, ids = index.search(queries, width)
    else:  # IndexFlatIP's search without the index's copy of ``base``
        sims, ids = faiss.knn(queries, base, width, metric=faiss.METRIC_INNER_PRODUCT)
    return ids.astype(np.int64), np.where(ids >= 0, sims, -np.inf)


def torch_candidates(queries: np.ndarray, base: np.ndarray, width: int, device: str) -> tuple[np.ndarray, np.ndarray]:
    torch = require("torch")
    x, q = (
        torch.from_numpy(np.ascontiguousarray(base)).to(device),
        torch.from_numpy(np.ascontiguousarray(queries)).to(device),
    )
    rows = max(1, min(4096, SIMILARITY_TILE_ELEMENTS // max(len(base), 1)))
    ids, sims = [], []
    with torch.inference_mode(), ieee_float32_matmul():  # TF32 would blur the candidates the exact ranking gets
        for start in progress_bar(range(0, len(q), rows), desc="kNN search", unit="tile", disable=len(q) <= rows):
            best = (q[start : start + rows] @ x.T).topk(width, dim=1)
            ids.append(best.indices.cpu())
            sims.append(best.values.cpu())
    return torch.cat(ids).numpy().astype(np.int64), torch.cat(sims).numpy()


def pair_scores(emb: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float64 inner products emb[rows[i]] . emb[cols[i]], computed one way for every caller."""
    return cross_scores(emb, emb, rows, cols)


def best_over_shards(data: str, layout: dict, rows, row_ids, k: int, backend: str, device, own: int | None = None):
    """Each row's k best nodes of every shard but itself (exact, ties by lower id): each shard gives its k
    best (:func:`best_in`) and the merge keeps the k best of those. Shard ``own`` is ``rows`` themselves."""
    ids, scores = empty_rows(len(rows), k)
    norms = row_norms(rows)
    for i, other in enumerate(index_shards(layout)):
        base = rows if i == own else read_node_embeddings(data, layout, other)
        floor = entry_floor(scores, norms, row_norms(base).max(initial=0.0), rows.shape[1])
        found_ids, found_scores = best_in(rows, row_ids, base, np.arange(*other.nodes), k, backend, device, floor)
        ids, scores = merge_best(ids, scores, found_ids, found_scores, k)
    return ids, scores


def read_node_embeddings(data: str, layout: dict, shard) -> np.ndarray:
    """One shard's node embeddings as float32, read from the index being written at ``data``."""
    return read_shard_rows(data, layout, [shard], "node_embeddings", verify=False).astype(np.float32, copy=False)


def csr_of_rows(ids: np.ndarray, scores: np.ndarray):
    """(indptr from 0, ids, float32 scores) of rows with k edges each, as a shard's graph is written."""
    return np.arange(len(ids) + 1, dtype=np.int64) * ids.shape[1], ids.reshape(-1), scores.astype(np.float32).ravel()


def best_in(rows, row_ids, base, base_ids, k: int, backend="auto", device=None, skip_below=None):
    """Each row's k best nodes of ``base`` (node ids ``base_ids``) but itself (``row_ids``; None: no row
    is a node of ``base``), by exact float64 score, ties by lower id: :func:`rank_candidates`'s rule over
    one block (candidates from a float32 search; a row whose k-th score ties its weakest candidate is
    ranked over the whole block). Padded with id ``PAD``, score -inf. RANK_ROWS rows at a time.

    ``skip_below`` (per row, from :func:`entry_floor`): a candidate whose float32 similarity is below it
    cannot enter the caller's k best, so it is not rescored (it counts as missing)."""
    if len(rows) <= RANK_ROWS:
        return _best_in_block(rows, row_ids, base, base_ids, k, backend, device, skip_below)
    parts = []
    for start in range(0, len(rows), RANK_ROWS):
        part = slice(start, start + RANK_ROWS)
        ids, floor = (None if x is None else x[part] for x in (row_ids, skip_below))
        parts.append(_best_in_block(rows[part], ids, base, base_ids, k, backend, device, floor))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _best_in_block(rows, row_ids, base, base_ids, k: int, backend, device, skip_below):
    """:func:`best_in` of one block of rows."""
    width = min(len(base), k + 1 + CANDIDATE_MARGIN)
    if width == 0:
        return empty_rows(len(rows), k)
    local, approx = search(rows, base, width, backend, device)
    cand = np.where(local >= 0, base_ids[np.maximum(local, 0)], -1)
    valid = local >= 0 if row_ids is None else (local >= 0) & (cand != row_ids[:, None])
    rescored = valid if skip_below is None else valid & (approx >= skip_below[:, None])
    pair_rows, pair_cols = np.nonzero(rescored)
    scores = np.full(cand.shape, -np.inf)
    scores[pair_rows, pair_cols] = cross_scores(rows, base, pair_rows, local[pair_rows, pair_cols])
    weakest = np.where(rescored, scores, np.inf).min(axis=1)
    order = np.lexsort((np.where(rescored, cand, PAD), -scores), axis=-1)
    cand, scores = np.take_along_axis(cand, order, 1), np.take_along_axis(scores, order, 1)
    kth = scores[:, min(k, width) - 1]
    # a tie may go on past the candidates; not where a candidate was skipped (the rest score lower still)
    unsure = (kth <= weakest) & (width < len(base)) & (rescored == valid).all(axis=1)
    for r in np.flatnonzero(unsure):
        all_scores = cross_scores(rows, base, np.full(len(base), r), np.arange(len(base)))
        keep = base_ids != (-1 if row_ids is None else row_ids[r])
        best = np.lexsort((base_ids[keep], -all_scores[keep]))[:width]
        cand[r, : len(best)], scores[r, : len(best)] = base_ids[keep][best], all_scores[keep][best]
    cand = np.where(np.isfinite(scores), cand, PAD)
    if width < k:
        cand = np.pad(cand, ((0, 0), (0, k - width)), constant_values=PAD)
        scores = np.pad(scores, ((0, 0), (0, k - width)), constant_values=-np.inf)
    return cand[:, :k], scores[:, :k]


def entry_floor(best_scores: np.ndarray, norms: np.ndarray, base_norm: float, dim: int) -> np.ndarray:
    """Per row, the float32 similarity a node needs to have a chance of entering ``best_scores`` (the
    row's k best so far, exact): its k-th score less :func:`search_slack`. -inf while a row has fewer
    than k."""
    return best_scores[:, -1] - search_slack(norms, base_norm, dim)


def search_slack(norms: np.ndarray, base_norm: float, dim: int) -> np.ndarray:
    """Per row (of norm ``norms``, against nodes of at most ``base_norm``), a bound on how far a float32
    similarity may be from the exact one (any summation order), 1e-6 to spare."""
    return float32_roundoff(dim) * norms * base_norm + 1e-6


def empty_rows(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k missing edges (id PAD, score -inf) for each of ``n`` rows, to merge into."""
    return np.full((n, k), PAD, np.int64), np.full((n, k), -np.inf)


def row_norms(x: np.ndarray) -> np.ndarray:
    """Each row's length, rounded up a little (the float32 computation's error is far smaller)."""
    return np.sqrt(np.einsum("ij,ij->i", x, x, dtype=np.float64)) * (1 + 1e-4)  # no squared copy of x


def merge_best(ids, scores, more_ids, more_scores, k: int):
    """Per row, the k best of two ranked lists by (score desc, id asc)."""
    both_ids, both_scores = np.concatenate([ids, more_ids], 1), np.concatenate([scores, more_scores], 1)
    order = np.lexsort((both_ids, -both_scores), axis=-1)[:, :k]
    return np.take_along_axis(both_ids, order, 1), np.take_along_axis(both_scores, order, 1)


def cross_scores(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """float64 inner products a[rows[i]] . b[cols[i]], each summed the same way whatever the batch."""
    a, b = (np.ascontiguousarray(x, dtype=np.float32) for x in (a, b))
    return pair_dots(a, b, np.asarray(rows, np.int64), np.asarray(cols, np.int64))
