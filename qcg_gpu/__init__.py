"""qcg-gpu: a GPU-accelerated batch engine for Query-Centric Graph RAG."""

from .config import (
    AnswerConfig,
    ChunkingConfig,
    GenerationConfig,
    GraphConfig,
    IndexConfig,
    NodeConfig,
    RetrievalConfig,
)
from .errors import QCGError

__version__ = "0.1.0"


def build_index(*args, **kwargs):
    """See :func:`qcg_gpu.build.pipeline.build_index` (imported lazily: it pulls in torch)."""
    from .build.pipeline import build_index as _build_index

    return _build_index(*args, **kwargs)


def __getattr__(name: str):
    if name in ("QCGRag", "QuerySolution"):  # the facade (qcg_gpu/api.py), imported when used
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'qcg_gpu' has no attribute {name!r}")


__all__ = [
    "build_index",
    "QCGRag",
    "QuerySolution",
    "IndexConfig",
    "ChunkingConfig",
    "GenerationConfig",
    "NodeConfig",
    "GraphConfig",
    "RetrievalConfig",
    "AnswerConfig",
    "QCGError",
]
