"""qcg-gpu: a GPU-accelerated batch engine for Query-Centric Graph RAG."""

from .config import ChunkingConfig, GenerationConfig, GraphConfig, IndexConfig, NodeConfig
from .errors import QCGError

__version__ = "0.1.0"


def build_index(*args, **kwargs):
    """See :func:`qcg_gpu.pipeline.build_index` (imported lazily: it pulls in torch)."""
    from .pipeline import build_index as _build_index

    return _build_index(*args, **kwargs)


__all__ = ["build_index", "IndexConfig", "ChunkingConfig", "GenerationConfig", "NodeConfig", "GraphConfig", "QCGError"]
