"""qcg-gpu: a GPU-accelerated batch engine for Query-Centric Graph RAG."""

from .capabilities import numba_threads_as_openmp, reproducible_mkl, user_cache_where_writable
from .config import (
    AnswerConfig,
    AnsweringLLMConfig,
    ChunkingConfig,
    GenerationConfig,
    GraphConfig,
    IndexConfig,
    NodeConfig,
    RetrievalConfig,
)
from .errors import QCGError

__version__ = "0.1.0"

reproducible_mkl()  # before the first GEMM of this process (capabilities.MKL_REPRODUCIBLE)
user_cache_where_writable()  # before numba, vLLM or Hugging Face look for their caches
numba_threads_as_openmp()  # before numba is imported


def build_index(*args, **kwargs):
    """See :func:`qcg_gpu.indexing.pipeline.build_index` (imported lazily: it pulls in torch)."""
    from .indexing.pipeline import build_index as _build_index

    return _build_index(*args, **kwargs)


_LAZY = {  # public names whose modules pull in torch, vLLM or Ray: imported when first used
    "QCGRag": "api",
    "QuerySolution": "api",
    "add_documents": "indexing.incremental",
    "remove_documents": "indexing.incremental",
    "retry_failed": "indexing.incremental",
    "RayCluster": "cluster",
    "index_settings": "api",
    "retrieval_settings": "api",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'qcg_gpu' has no attribute {name!r}")


__all__ = [
    "build_index",
    "add_documents",
    "remove_documents",
    "retry_failed",
    "RayCluster",
    "QCGRag",
    "QuerySolution",
    "IndexConfig",
    "ChunkingConfig",
    "GenerationConfig",
    "NodeConfig",
    "GraphConfig",
    "RetrievalConfig",
    "AnswerConfig",
    "AnsweringLLMConfig",
    "index_settings",
    "retrieval_settings",
    "QCGError",
]
