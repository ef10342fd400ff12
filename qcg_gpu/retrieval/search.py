"""One way in for every caller (the CLI, the evaluation, Ray workers, the Python API):
:func:`search` for any method, :class:`Retriever` to keep one QCG backend across calls.

Every backend honours the same contract (:class:`Backend`): checked unit queries (B, d) and a
:class:`RetrievalConfig` in, one :class:`RetrievalResult` out, equal across backends."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from ..capabilities import WITH_TORCH, cpu_has_fast_bf16, default_device, require, with_cuda
from ..config import BASELINES, RetrievalConfig
from ..errors import QCGError
from .index import QCGIndex
from .result import RetrievalResult, check_queries

METHODS = ("qcg",) + BASELINES


class Backend(Protocol):
    def search(self, queries: np.ndarray, config: RetrievalConfig) -> RetrievalResult:
        """B unit queries (float32, contiguous) in; their seeds and top-K chunks out."""


def backend_name(config: RetrievalConfig) -> str:
    """numpy or torch: ``auto`` takes torch where CUDA is, numpy (numba kernels) elsewhere."""
    if config.backend != "auto":
        return config.backend
    return "torch" if with_cuda() else "numpy"


def use_prefilter(config: RetrievalConfig, device: str = "cpu") -> bool:
    """auto: bf16 where it is fast, i.e. CUDA GPUs with bf16 tensor cores (Ampere on) and CPUs with AMX/AVX512-BF16."""
    if config.prefilter != "auto":
        return config.prefilter == "bf16"
    if backend_name(config) == "torch" and device.startswith("cuda"):
        return require("torch").cuda.get_device_capability(device)[0] >= 8
    return backend_name(config) == "numpy" and WITH_TORCH and cpu_has_fast_bf16()


def make_backend(index: QCGIndex, config: RetrievalConfig, cluster=None) -> Backend:
    """The backend ``config`` names over ``index``; with a :class:`distributed.RayCluster`, the
    queries split over its workers, each running that backend."""
    if cluster is not None:
        from .ray_backend import RayBackend

        return RayBackend(index, cluster)
    name = backend_name(config)
    if name == "torch":
        from .torch_backend import TorchBackend

        device = config.device or default_device()
        return TorchBackend(index, device, use_prefilter(config, device))
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend(index, use_prefilter(config))
    raise QCGError(f"unknown retrieval backend {name!r}")


class Retriever:
    """Batched QCG retrieval over one index. It reuses its work buffers between calls, so use one
    ``Retriever`` per thread (the Ray workers each hold their own)."""

    def __init__(self, index: QCGIndex | str | Path, config: RetrievalConfig | None = None, cluster=None):
        self.index = index if isinstance(index, QCGIndex) else QCGIndex.load(index)
        self.config = (config or RetrievalConfig()).validate()
        self.backend = make_backend(self.index, self.config, cluster)

    def search(self, queries: np.ndarray, config: RetrievalConfig | None = None) -> RetrievalResult:
        config = (config or self.config).validate()
        return self.backend.search(check_queries(queries, self.index.dim), config)


def search(
    index: QCGIndex, queries: np.ndarray, config: RetrievalConfig, method: str = "qcg", embedder=None, cluster=None
) -> RetrievalResult:
    """The top-K chunks of each query by ``method``: QCG retrieval (on ``cluster``'s workers when
    given) or a naive-RAG baseline, which embeds chunk texts and so needs the index's ``embedder``."""
    if method == "qcg":
        return Retriever(index, config, cluster).search(queries)
    if method not in BASELINES:
        raise QCGError(f"unknown retrieval method {method!r} (choose from {', '.join(METHODS)})")
    if cluster is not None:
        raise QCGError(f"--ray runs QCG retrieval; --method {method} retrieves in this process")
    if embedder is None:
        raise QCGError(f"{method} embeds chunk texts and needs the index's embedder")
    from .baselines import baseline_search

    return baseline_search(index, method, embedder, check_queries(queries, index.dim), config.validate())
