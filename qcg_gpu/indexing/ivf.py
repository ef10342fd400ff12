"""The approximate kNN graph (``--knn approximate``, METHOD.md index step 4): inverted lists (IVF),
defined so that any split of the nodes into shards gives the same graph, edge for edge.

1. Lists: spherical k-means (faiss, seeded) on a fixed sample of the nodes (:func:`training_rows`),
   ~4 sqrt(N) centroids (at most MAX_LISTS), trained once, in one process.
2. Each node's ``probes`` nearest centroids by exact (float64) inner product, ties by lower list id
   (:func:`nearest_lists`); the first is the list the node belongs to.
3. Row i: the k best nodes other than i by exact score, ties by lower id, among the members of i's
   probed lists. A row whose probed lists hold fewer than k other nodes is ranked over every node.

Step 3 goes list by list (:func:`probed_rows`, the kernel ``kernels/ivf_cpu.py``): each row that
probes a list looks at every member, skips those whose float32 similarity shows they cannot enter its
k best, and scores the rest exactly into them. One process takes all nodes as one base
(:func:`ivf_graph`); a sharded build takes the members shard by shard (:func:`shard_rows`, one Ray
task per shard holding two shards of embeddings at most), and the k best come out the same. A true
neighbour outside the probed lists is missed: edge recall is measured by ``qcg bench --parts knn``.
"""

from __future__ import annotations

import numpy as np

from ..capabilities import require
from ..index_format import index_shards, load_shard_array
from ..kernels.ivf_cpu import Best, Lists, Probes, probe_lists
from ..log import progress_bar
from .ranking import (
    best_in,
    best_over_shards,
    csr_of_rows,
    degree,
    empty_rows,
    read_node_embeddings,
    row_norms,
    search_slack,
)

TRAIN_PER_LIST = 39  # faiss' minimum of training points per k-means centroid
SAMPLE_PER_LIST = 64  # training points per centroid
# Past 268M nodes, 4 sqrt(N) lists would need a sample larger than a shard (at 1B nodes: 126k lists,
# 8.1M rows, 12 GB at 384-d) and k-means time to match; faiss's guidance for a billion vectors is
# 65,536 lists trained on a few million. So at most 65,536 lists, trained on 4.2M rows (6.4 GB at 384-d).
MAX_LISTS = 65536
KMEANS_ITERATIONS = 10
KMEANS_SEED = 1234
ROW_BLOCK = 65536  # rows per kernel call


def list_count(n: int) -> int:
    """Inverted lists for ``n`` nodes: ~4 sqrt(n), with enough training points for each, at most MAX_LISTS."""
    return int(max(1, min(4 * np.sqrt(n), n // TRAIN_PER_LIST, MAX_LISTS)))


def training_rows(n: int) -> np.ndarray:
    """The node ids k-means trains on: a fixed sample, in order."""
    size = min(n, list_count(n) * SAMPLE_PER_LIST)
    return np.sort(np.random.default_rng(0).choice(n, size, replace=False))


def train_centroids(sample: np.ndarray, lists: int) -> np.ndarray:
    """``lists`` unit-length centroids of ``sample`` (float32), by seeded spherical k-means."""
    faiss = require("faiss")
    kmeans = faiss.Kmeans(sample.shape[1], lists, niter=KMEANS_ITERATIONS, seed=KMEANS_SEED, spherical=True)
    kmeans.train(np.ascontiguousarray(sample, dtype=np.float32))
    return kmeans.centroids


def nearest_lists(x: np.ndarray, centroids: np.ndarray, probes: int, backend="auto", device=None) -> np.ndarray:
    """Each row's ``probes`` nearest centroids (ids, best first) by exact score, ties by lower id."""
    probes = min(probes, len(centroids))
    return best_in(x, None, centroids, np.arange(len(centroids)), probes, backend, device)[0]


def list_search(backend: str) -> str:
    """The float32 search for each node's nearest centroids: torch for ``auto``. faiss's own OpenMP
    runtime would spin against numba's (the kernels) for the cores (benchmarks/RESULTS.md, *kNN graphs*)."""
    return "torch" if backend == "auto" else backend


def probed_rows(rows, row_ids, row_lists, base, base_ids, base_list, best) -> None:
    """Merge into ``best`` (each row's ids and float64 scores, ranked) the members of ``base`` (node ids
    ``base_ids``, list ``base_list``) in each row's probed lists ``row_lists`` (the kernel
    ``ivf_cpu.probe_lists``, on blocks of rows so that the bar moves)."""
    by_list = np.argsort(base_list, kind="stable")
    n_lists = int(max(row_lists.max(initial=-1), base_list.max(initial=-1))) + 1
    lists = Lists(by_list, np.searchsorted(base_list[by_list], np.arange(n_lists + 1)))
    slack = search_slack(row_norms(rows), row_norms(base).max(initial=0.0), rows.shape[1])
    for start in progress_bar(
        range(0, len(rows), ROW_BLOCK), desc="IVF rows", unit="block", disable=len(rows) <= ROW_BLOCK
    ):
        block = np.arange(start, min(start + ROW_BLOCK, len(rows)))
        probing = np.argsort(row_lists[block], axis=None, kind="stable")  # (row, probe) pairs, list by list
        probed = row_lists[block].ravel()[probing]
        groups = np.flatnonzero(np.r_[True, probed[1:] != probed[:-1]]) if len(probed) else probed
        probes = Probes(probed[groups], block[probing // row_lists.shape[1]], np.r_[groups, len(probed)])
        probe_lists(rows, row_ids, base, base_ids, lists, probes, Best(best[0], best[1], slack))


def short_rows(best) -> np.ndarray:
    """The rows whose probed lists held fewer than k other nodes."""
    return np.flatnonzero(np.isneginf(best[1][:, -1])) if best[1].shape[1] else np.zeros(0, np.int64)


def ivf_graph(emb: np.ndarray, k: int, probes: int, backend="auto", device=None, centroids=None):
    """The approximate graph of ``emb`` (unit rows, float32) in one process: (ids, scores), k a row;
    ``centroids`` default to :func:`train_centroids` on :func:`training_rows`."""
    return graph_rows(emb, 0, len(emb), k, graph_lists(emb, probes, backend, device, centroids), backend, device)


def graph_lists(emb: np.ndarray, probes: int, backend="auto", device=None, centroids=None) -> np.ndarray:
    """Each node's ``probes`` nearest lists (the first, its own), centroids trained as :func:`ivf_graph` says."""
    if centroids is None:
        centroids = train_centroids(emb[training_rows(len(emb))], list_count(len(emb)))
    return nearest_lists(emb, centroids, probes, list_search(backend), device)


def graph_rows(emb: np.ndarray, start: int, stop: int, k: int, lists: np.ndarray, backend="auto", device=None):
    """Rows ``start:stop`` of :func:`ivf_graph` (each row depends only on its node, the lists and every
    node, so row blocks can be separate Ray tasks): (ids, scores)."""
    node_ids, row_ids = np.arange(len(emb)), np.arange(start, stop)
    best = empty_rows(stop - start, k)
    probed_rows(emb[start:stop], row_ids, lists[start:stop], emb, node_ids, lists[:, 0], best)
    short = short_rows(best)
    if len(short):
        best[0][short], best[1][short] = best_in(
            emb[start + short], start + short, emb, node_ids, k, list_search(backend), device
        )
    return best[0], best[1].astype(np.float32)


# ---- the same graph of a sharded index, a task per shard (``distributed.knn_of_shards``) ------------


def centroids_of_shards(data: str, layout: dict) -> np.ndarray:
    """:func:`train_centroids` on the training rows of every shard's nodes, copied into one array from
    each shard's memory map: only the sample is held, and no shard is read whole."""
    shards = index_shards(layout)
    n = shards[-1].nodes[1]
    wanted = training_rows(n)

    def mapped(shard) -> np.ndarray:
        return load_shard_array(data, layout, shard, "node_embeddings", mmap=True, verify=False)

    sample = np.empty((len(wanted), mapped(shards[0]).shape[1]), np.float32)
    for shard in shards:
        lo, hi = np.searchsorted(wanted, shard.nodes)
        if hi > lo:
            rows = mapped(shard)
            for start in range(lo, hi, ROW_BLOCK):  # a block's copy at a time
                stop = min(start + ROW_BLOCK, hi)
                sample[start:stop] = rows[wanted[start:stop] - shard.nodes[0]]
            del rows  # unmapped before the next shard's
    return train_centroids(sample, list_count(n))


def shard_lists(data: str, layout: dict, shard: int, centroids, probes: int, backend="auto", device=None):
    """The probed lists of one shard's nodes, and (a copy, sent to every other shard's task) their own lists."""
    rows = read_node_embeddings(data, layout, index_shards(layout)[shard])
    lists = nearest_lists(rows, centroids, probes, list_search(backend), device)
    return lists, lists[:, 0].copy()


def shard_rows(data: str, layout: dict, shard: int, k: int, lists: np.ndarray, list_of, backend="auto", device=None):
    """The approximate kNN rows of node shard ``shard`` (its CSR, as ``knn.shard_rows`` gives it), its
    nodes (probing ``lists``) against the members of every shard (``list_of(i)``: shard i's lists), read
    one shard at a time. Equal to those rows of :func:`ivf_graph` with the same centroids."""
    shards, backend = index_shards(layout), list_search(backend)
    rows = read_node_embeddings(data, layout, shards[shard])
    row_ids = np.arange(*shards[shard].nodes)
    k_eff = degree(k, shards[-1].nodes[1])
    best = empty_rows(len(rows), k_eff)
    for i, other in enumerate(shards):
        base = rows if i == shard else read_node_embeddings(data, layout, other)
        probed_rows(rows, row_ids, lists, base, np.arange(*other.nodes), list_of(i), best)
    short = short_rows(best)
    if len(short):
        best[0][short], best[1][short] = best_over_shards(
            data, layout, rows[short], row_ids[short], k_eff, backend, device
        )
    return csr_of_rows(*best)
