"""Retrieval over a node-sharded index on Ray (issue 36): each worker holds only its shards, and the
result equals one process's bit for bit.

Each :class:`ShardOwner` loads a contiguous range of an index's node shards from their files alone
(node embeddings, kNN rows, each node's chunk) and searches them with the backend one process would
run there (``retriever.local_backend``, passed in: torch on the worker's GPU where it has one, numpy
otherwise).
One batch of queries then goes in three steps (METHOD.md, retrieval steps 2-5), the driver holding
only per-query lists:

1. Seeds: every owner returns its best n nodes with their float64 similarities, the numbers the
   one-process backend ranks by (``NumpyBackend.seeds``, ``TorchBackend.seeds``); the driver merges
   them by (similarity desc, node id asc) and keeps n. Ids are global, so this is the one-process choice.
2. Expansion, h rounds: the driver asks the owners of the current frontier for their kNN rows and
   appends each unseen neighbour in the order the one-process breadth-first walk finds it.
3. Chunks: every owner gets the nodes of Q* it holds, in Q*'s order, and scores its own chunks as the
   one-process backend does (``rank``: the same dot products, each chunk's sum in the same order); a
   chunk's nodes never span two shards, so each owner's top-K is exact, and the driver merges them by
   (score desc, chunk id asc).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numba
import numpy as np

from ..config import RetrievalConfig
from ..errors import QCGError
from ..index_format import (
    Shard,
    data_dir,
    index_shards,
    join_indptr,
    load_shard_array,
    load_shard_table,
    read_shard_rows,
)
from .index import QCGIndex
from .result import RetrievalResult


def owner_groups(shards: list[Shard], owners: int) -> list[list[Shard]]:
    """Consecutive shards shared out to ``owners`` groups of about equal node counts (none empty)."""
    owners = max(1, min(owners, len(shards)))
    sizes = np.array([s.nodes[1] - s.nodes[0] for s in shards], dtype=np.float64)
    ends = np.cumsum(sizes)
    targets = ends[-1] * np.arange(1, owners) / owners
    cuts = np.unique(np.clip(np.searchsorted(ends, targets, side="left") + 1, 1, len(shards) - 1))
    return [list(group) for group in np.split(np.array(shards, dtype=object), cuts) if len(group)]


class ShardOwner:
    """A worker's node shards (a contiguous range of them), loaded from their own files and nothing else."""

    def __init__(self, path: str, manifest: dict, shard_names: list[str], local_backend, verify: bool = True):
        """``local_backend(index, config)``: the in-process backend ``config`` names (``retriever.local_backend``,
        passed in so that this module needs nothing from ``retriever``)."""
        shards = [s for s in index_shards(manifest) if s.name in set(shard_names)]
        if [s.name for s in shards] != list(shard_names) or any(
            a.nodes[1] != b.nodes[0] for a, b in zip(shards, shards[1:])
        ):
            raise QCGError(f"shards {shard_names} are not consecutive shards of {path}")
        data = data_dir(path, manifest)
        self.first_node, self.end_node = shards[0].nodes[0], shards[-1].nodes[1]
        self.first_chunk, end_chunk = shards[0].chunks[0], shards[-1].chunks[1]

        def array(name: str) -> list[np.ndarray]:
            return [load_shard_array(data, manifest, s, name, mmap=False, verify=verify) for s in shards]

        self.indptr = join_indptr(array("knn_indptr")).astype(np.int64)
        self.indices = np.concatenate(array("knn_indices")).astype(np.int64)
        node_chunk = np.concatenate(
            [load_shard_table(data, manifest, s, "nodes", verify).column("chunk_id").to_numpy() for s in shards]
        ).astype(np.int64)
        self._files = (Path(path), manifest, data, shards, verify)
        self._node_chunk, self._n_chunks = node_chunk - self.first_chunk, end_chunk - self.first_chunk
        self.local: QCGIndex | None = self._load_local()
        self._local_backend = local_backend
        self._backends: dict = {}  # (backend, device, prefilter) -> the in-process backend over these nodes

    def _load_local(self) -> QCGIndex:
        """This owner's nodes as an index of their own, read from the shard files (no edges: the driver
        walks the graph)."""
        path, manifest, data, shards, verify = self._files
        emb = read_shard_rows(data, manifest, shards, "node_embeddings", verify).astype(np.float32, copy=False)
        empty_graph = np.zeros(len(emb) + 1, np.int64), np.zeros(0, np.int64)
        return QCGIndex(path, manifest, emb, *empty_graph, self._node_chunk, self._n_chunks, verified=verify, data=data)

    def nodes(self) -> tuple[int, int]:
        return self.first_node, self.end_node

    def seeds(self, queries: np.ndarray, config: RetrievalConfig):
        """This owner's best n seeds per query (global ids, -1 padded) and their float64 similarities."""
        ids, sims = self._backend(config).seeds(queries, config)
        return np.where(ids >= 0, ids + self.first_node, -1), sims

    def rows(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The kNN rows of ``nodes`` (global ids this owner holds): their lengths and the neighbours, in order."""
        local = nodes - self.first_node
        starts, ends = self.indptr[local], self.indptr[local + 1]
        return ends - starts, _gather_rows(self.indices, starts, ends)

    def rank(self, queries: np.ndarray, ptr: np.ndarray, nodes: np.ndarray, config: RetrievalConfig):
        """Top-K of this owner's chunks per query from its nodes of Q* (``nodes[ptr[b]:ptr[b+1]]``, global
        ids in Q*'s order), by the backend that one process would run (a chunk's nodes are all here)."""
        width = int(np.diff(ptr).max()) if len(queries) else 0
        selected = np.full((len(queries), max(width, 1)), -1, np.int64)
        _fill_padded(selected, ptr, nodes - self.first_node)
        chunks, scores = self._backend(config).rank(queries, selected, config.top_k)
        return np.where(chunks >= 0, chunks + self.first_chunk, -1), scores

    def _backend(self, config: RetrievalConfig):
        """The backend ``config`` names over this owner's nodes, chosen here: on a worker with a GPU,
        ``auto`` is torch on it; the prefilter is this CPU's or GPU's fastest (every one is exact)."""
        key = (config.backend, config.device, config.prefilter)
        if key not in self._backends:
            local = self.local or self._load_local()  # freed by a GPU backend before: read again
            self._backends[key] = backend = self._local_backend(local, config)
            # a backend on a GPU searches its own copy of the nodes: the host's would only hold memory
            self.local = None if str(getattr(backend, "device", "cpu")) != "cpu" else local
        return self._backends[key]


class ShardedBackend:
    """QCG retrieval over ``owners``, whose methods ``call`` runs, all owners at once (a list of (owner,
    method name, arguments) in, their results out): Ray actors holding a :class:`ShardOwner` each on a
    cluster (:func:`ray_owners`), or plain ones in this process (:func:`local_owners`)."""

    def __init__(self, owners: list, bounds: np.ndarray, call):
        self.owners, self.bounds, self.call = owners, bounds, call
        self.bytes_moved = 0  # driver <-> owner payload bytes (arrays), for the benchmark

    def search(self, queries: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        out = RetrievalResult.empty(len(queries), config)
        if not len(queries):
            return out
        seed_ids, seed_sims = self._seeds(queries, config)
        out.seed_ids[:, : seed_ids.shape[1]], out.seed_sims[:, : seed_ids.shape[1]] = seed_ids, seed_sims
        ptr, selected = _seed_lists(seed_ids)
        frontier = ptr[:-1].copy()
        for _ in range(config.hops):
            wanted = np.unique(_frontier_nodes(ptr, selected, frontier))
            rows_ptr, neighbours = self._rows(wanted)
            ptr, selected, frontier = _expand_round(ptr, selected, frontier, wanted, rows_ptr, neighbours)
        out.n_selected[:] = np.diff(ptr)
        out.chunk_ids[:], out.scores[:] = self._rank(queries, ptr, selected, config)
        return out

    def _gather(self, name: str, args_of) -> list:
        """``name`` on every owner, each with its own arguments; the results in owner order."""
        calls = [(owner, args_of(i)) for i, owner in enumerate(self.owners)]
        self.bytes_moved += sum(_nbytes(args) for _, args in calls)
        results = self.call([(owner, name, args) for owner, args in calls])
        self.bytes_moved += sum(_nbytes(r) for r in results)
        return results

    def _seeds(self, queries: np.ndarray, config: RetrievalConfig) -> tuple[np.ndarray, np.ndarray]:
        return _best_of(self._gather("seeds", lambda i: (queries, config)), config.n)

    def _rows(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cuts = np.searchsorted(wanted, self.bounds[1:-1])
        asked = np.split(wanted, cuts)
        parts = self._gather("rows", lambda i: (asked[i],))
        lengths = np.concatenate([p[0] for p in parts])
        return np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([p[1] for p in parts])

    def _rank(self, queries, ptr, selected, config: RetrievalConfig):
        owner = np.searchsorted(self.bounds, selected, side="right") - 1
        query_of = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))

        def args(i):
            mine = owner == i
            counts = np.bincount(query_of[mine], minlength=len(ptr) - 1)
            return queries, np.concatenate([[0], np.cumsum(counts)]), selected[mine], config

        return _best_of(self._gather("rank", args), config.top_k)


def local_owners(index_path, manifest: dict, owners: int, local_backend, verify: bool = True) -> ShardedBackend:
    """A :class:`ShardedBackend` whose owners live in this process (one machine, tests)."""
    groups = owner_groups(index_shards(manifest), owners)
    made = [ShardOwner(str(index_path), manifest, [s.name for s in g], local_backend, verify) for g in groups]
    return ShardedBackend(made, _bounds(groups), _call_local)


class ShardActor:
    """A Ray actor holding one :class:`ShardOwner`, kept across searches of the same index version. It
    records every shard file its process opens (``files_opened``), whoever opens it: where a worker
    reads its shards from is worth knowing on a cluster, and the tests check it reads only its own."""

    def __init__(self):
        self.key, self.owner, self.opened = None, None, set()
        sys.addaudithook(self._record)

    def _record(self, event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str) and f"{os.sep}shards{os.sep}" in args[0]:
            self.opened.add(args[0])

    def files_opened(self) -> list[str]:
        return sorted(self.opened)

    def gpu_ids(self) -> list:
        """The GPUs Ray gave this worker (torch's ``cuda`` is the first): one each on a GPU cluster."""
        import ray

        return ray.get_gpu_ids()

    def peak_rss(self) -> int:
        """This worker process's peak resident memory in bytes (VmHWM): what its shards cost it."""
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))

    def load(self, path: str, manifest: dict, shard_names: list[str], local_backend, verify: bool) -> tuple[int, int]:
        key = (path, manifest.get("data_dir"), tuple(shard_names), verify)
        if key != self.key:
            self.owner, self.key = None, None  # the old shards go before the new ones load
            self.owner, self.key = ShardOwner(path, manifest, shard_names, local_backend, verify), key
        return self.owner.nodes()

    def call(self, name: str, *args):
        return getattr(self.owner, name)(*args)


def ray_owners(cluster, index: QCGIndex, local_backend) -> ShardedBackend:
    """A :class:`ShardedBackend` whose owners are actors on ``cluster``'s workers (one per worker, or
    per shard where there are fewer), each loading its shards from the index's files."""
    groups = owner_groups(index.shards, cluster.workers)
    actors = cluster.actors(ShardActor, reuse=True, count=len(groups))
    path = str(index.path)
    loads = [
        a.load.remote(path, index.manifest, [s.name for s in g], local_backend, index.verified)
        for a, g in zip(actors, groups)
    ]
    _ray_results(cluster, loads)

    def call(calls: list) -> list:
        return _ray_results(cluster, [owner.call.remote(name, *args) for owner, name, args in calls])

    return ShardedBackend(actors, _bounds(groups), call)


def _ray_results(cluster, futures: list) -> list:
    """The results of ``futures``; a worker's QCGError (a corrupt shard, say) as the one-line error it is."""
    try:
        return cluster.gather(futures)
    except cluster.ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, QCGError):
            raise QCGError(str(exc.cause)) from None
        raise


def _call_local(calls: list) -> list:
    return [getattr(owner, name)(*args) for owner, name, args in calls]


def _bounds(groups: list[list[Shard]]) -> np.ndarray:
    """Each owner's first node id, then the end of the last: owner i holds [bounds[i], bounds[i+1])."""
    return np.array([g[0].nodes[0] for g in groups] + [groups[-1][-1].nodes[1]], dtype=np.int64)


def _nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


def _best_of(parts: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The owners' ranked (ids, values) lists merged per row: the k best by value desc, then id asc
    (padding, id -1 with value -inf, last)."""
    ids = np.concatenate([p[0] for p in parts], axis=1)
    values = np.concatenate([p[1] for p in parts], axis=1)
    order = np.lexsort((np.where(ids >= 0, ids, np.iinfo(np.int64).max), -values), axis=-1)[:, :k]
    return np.take_along_axis(ids, order, 1), np.take_along_axis(values, order, 1)


@numba.njit(cache=True)
def _gather_rows(indices, starts, ends):
    out = np.empty(int((ends - starts).sum()), dtype=indices.dtype)
    pos = 0
    for i in range(len(starts)):
        for e in range(starts[i], ends[i]):
            out[pos] = indices[e]
            pos += 1
    return out


@numba.njit(cache=True)
def _fill_padded(out, ptr, values):
    for b in range(len(ptr) - 1):
        for j in range(ptr[b], ptr[b + 1]):
            out[b, j - ptr[b]] = values[j]


def _seed_lists(seed_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query's seeds (best first, -1 padding dropped) as CSR lists: the start of Q*."""
    valid = seed_ids >= 0
    ptr = np.concatenate([[0], np.cumsum(valid.sum(axis=1))]).astype(np.int64)
    return ptr, seed_ids[valid].astype(np.int64)


@numba.njit(cache=True)
def _frontier_nodes(ptr, selected, frontier):
    out = np.empty(int((ptr[1:] - frontier).sum()), dtype=np.int64)
    pos = 0
    for b in range(len(ptr) - 1):
        for i in range(frontier[b], ptr[b + 1]):
            out[pos] = selected[i]
            pos += 1
    return out


@numba.njit(cache=True)
def _expand_round(ptr, selected, frontier, wanted, rows_ptr, neighbours):
    """One hop of every query's breadth-first walk (``expand_cpu.expand``'s order): the neighbours of its
    frontier nodes (``selected[frontier[b]:ptr[b+1]]``, rows looked up in ``wanted``/``rows_ptr``), each
    unseen one appended once. Returns the new lists and frontiers."""
    n_queries = len(ptr) - 1
    bound = 0
    for b in range(n_queries):
        bound += ptr[b + 1] - ptr[b]
        for i in range(frontier[b], ptr[b + 1]):
            r = np.searchsorted(wanted, selected[i])
            bound += rows_ptr[r + 1] - rows_ptr[r]
    out = np.empty(bound, dtype=np.int64)
    new_ptr = np.zeros(n_queries + 1, dtype=np.int64)
    new_frontier = np.zeros(n_queries, dtype=np.int64)
    pos = 0
    for b in range(n_queries):
        seen = set()
        for i in range(ptr[b], ptr[b + 1]):
            out[pos] = selected[i]
            seen.add(selected[i])
            pos += 1
        new_frontier[b] = pos
        for i in range(frontier[b], ptr[b + 1]):
            r = np.searchsorted(wanted, selected[i])
            for e in range(rows_ptr[r], rows_ptr[r + 1]):
                v = neighbours[e]
                if v not in seen:
                    seen.add(v)
                    out[pos] = v
                    pos += 1
        new_ptr[b + 1] = pos
    return new_ptr, out[:pos], new_frontier
