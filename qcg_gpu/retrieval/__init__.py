"""Batched retrieval (METHOD.md, "Retrieval" and "Baselines"): B queries at once, as dense GEMM
tiles plus sparse steps; the B x N similarity matrix is never held beyond one tile of queries.

One contract for every backend (``retriever.Backend``: unit queries and a RetrievalConfig in, a
RetrievalResult out, equal across backends), one entry point (:func:`search`):

=================  ==========================================================================
``retriever``      the entry point :func:`search`, the backend choice and :class:`Retriever`
``index``          :class:`QCGIndex`, the arrays retrieval reads from an index directory
``result``         :class:`RetrievalResult`, the query check, the seed threshold, tile sizes
``numpy_backend``  CPU: BLAS GEMM + numba kernels (``qcg_gpu/kernels/``), bf16 or int8 prefilter
``torch_backend``  torch tensors: CUDA when present, CPU tensors otherwise
``bounds``         the error bounds that keep the bf16 and int8 prefilters exact
``ray_backend``    the queries split over Ray workers
``shard_backend``  a sharded index on Ray: each worker owns its node shards, the driver merges
``baselines``      naive RAG, D2Q and D2Q-- over chunk embeddings
``trace``          the case-study view of one query
=================  ==========================================================================
"""

from ..config import PRESETS, RetrievalConfig
from .index import QCGIndex
from .result import RetrievalResult, check_queries, seed_threshold
from .retriever import BASELINES, METHODS, Retriever, search
from .trace import trace_queries, trace_query

__all__ = [
    "BASELINES",
    "METHODS",
    "PRESETS",
    "QCGIndex",
    "RetrievalConfig",
    "RetrievalResult",
    "Retriever",
    "check_queries",
    "search",
    "seed_threshold",
    "trace_queries",
    "trace_query",
]
