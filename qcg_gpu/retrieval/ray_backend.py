"""Retrieval split over Ray workers: each holds the index (through the object store, zero-copy)
and one :class:`Retriever`; the queries are split in order and the results put back together,
equal to one process's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..config import RetrievalConfig
from .index import QCGIndex
from .result import RetrievalResult


class RetrievalWorker:
    """A Ray actor's state: one local backend per index and backend kind, so sweeps load each
    index once."""

    def __init__(self):
        self.backends = {}

    def search(
        self, key: str, index_ref: list, config: RetrievalConfig, queries: np.ndarray, local_backend: Callable
    ) -> RetrievalResult:
        import ray

        if key not in self.backends:  # the ref comes in a list so that Ray fetches the index only here
            self.backends[key] = local_backend(ray.get(index_ref[0]), config)
        return self.backends[key].search(queries, config)


class RayBackend:
    """The queries split over ``cluster``'s workers, each running ``local_backend(index, config)``
    (``retriever.local_backend``, passed in so that this module needs nothing from ``retriever``)."""

    def __init__(self, index: QCGIndex, cluster, local_backend: Callable):
        self.index, self.cluster, self.local_backend = index, cluster, local_backend

    def search(self, queries: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        workers = self.cluster.actors(RetrievalWorker, reuse=True)
        ref = self.cluster.share(self.index)
        key = f"{id(self.index)}:{config.backend}:{config.prefilter}:{config.device}"
        shards = [s for s in np.array_split(np.arange(len(queries)), len(workers)) if len(s)]
        futures = [
            w.search.remote(key, [ref], config, queries[s[0] : s[-1] + 1], self.local_backend)
            for w, s in zip(workers, shards)
        ]
        return RetrievalResult.concatenate(self.cluster.gather(futures))
