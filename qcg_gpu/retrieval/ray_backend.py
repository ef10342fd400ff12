"""Retrieval split over Ray workers: each holds the index (through the object store, zero-copy)
and one :class:`Retriever`; the queries are split in order and the results put back together,
equal to one process's."""

from __future__ import annotations

import numpy as np

from ..config import RetrievalConfig
from .index import QCGIndex
from .result import RetrievalResult


class RetrievalWorker:
    """A Ray actor's state: one Retriever per index and backend, so sweeps load each index once."""

    def __init__(self):
        self.retrievers = {}

    def search(self, key: str, index_ref: list, config: RetrievalConfig, queries: np.ndarray) -> RetrievalResult:
        import ray

        from .search import Retriever

        if key not in self.retrievers:  # the ref comes in a list so that Ray fetches the index only here
            self.retrievers[key] = Retriever(ray.get(index_ref[0]), config)
        return self.retrievers[key].search(queries, config)


class RayBackend:
    def __init__(self, index: QCGIndex, cluster):
        self.index, self.cluster = index, cluster

    def search(self, queries: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        from ..build.distributed import gather

        workers = self.cluster.actors(RetrievalWorker, reuse=True)
        ref = self.cluster.share(self.index)
        key = f"{id(self.index)}:{config.backend}:{config.prefilter}:{config.device}"
        shards = [s for s in np.array_split(np.arange(len(queries)), len(workers)) if len(s)]
        futures = [w.search.remote(key, [ref], config, queries[s[0] : s[-1] + 1]) for w, s in zip(workers, shards)]
        return RetrievalResult.concatenate(gather(self.cluster.ray, futures))
