"""One way in for every caller (the CLI, the evaluation, Ray workers, the Python API):
:func:`search` for any method, :class:`Retriever` to keep one QCG backend across calls.

Every backend honours the same contract (:class:`Backend`): checked unit queries (B, d) and a
:class:`RetrievalConfig` in, one :class:`RetrievalResult` out, equal across backends."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Protocol

import numpy as np

from ..capabilities import (
    WITH_TORCH,
    check_device,
    cpu_has_amx,
    cpu_has_avx2,
    default_device,
    require,
    with_cuda,
)
from ..config import BASELINES, RetrievalConfig
from ..errors import QCGError
from ..index_format import index_shards
from ..log import logger
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


def prefilter_kind(config: RetrievalConfig, device: str = "cpu", dim: int | None = None) -> str | None:
    """The GEMM precision that prefilters the seeds ("bf16", "int8") or None for the float32 GEMM.
    auto, the fastest measured (benchmarks/RESULTS.md): bf16 on CUDA GPUs from Ampere on and on
    CPUs with AMX, int8 on other x86 CPUs (AVX2 and later) whose int8 GEMM sums ``dim`` products
    exactly (``int8_gemm.node_code_max``), the float32 GEMM elsewhere."""
    name = backend_name(config)
    if config.prefilter == "int8" and name != "numpy":
        raise QCGError("--prefilter int8 runs on the numpy backend (CPU); the torch backend takes off or bf16")
    if config.prefilter != "auto":
        return None if config.prefilter == "off" else config.prefilter
    if name == "torch" and device.startswith("cuda"):
        return "bf16" if require("torch").cuda.get_device_capability(device)[0] >= 8 else None
    if name != "numpy" or not WITH_TORCH:
        return None
    if cpu_has_amx():
        return "bf16"
    if not cpu_has_avx2():
        return None
    from . import int8_gemm

    return "int8" if dim is None or int8_gemm.node_code_max(int8_gemm.for_this_cpu(), dim) > 0 else None


def make_backend(index: QCGIndex, config: RetrievalConfig, cluster=None) -> Backend:
    """The backend ``config`` names over ``index``; with a :class:`cluster.RayCluster`, its workers
    each hold their node shards (``ray_mode`` shards), or the whole index and a share of the queries."""
    if cluster is not None and ray_mode(cluster.config.ray_mode, index.manifest) == "shards":
        from .shard_backend import ray_owners

        return ray_owners(cluster, index, local_backend)  # each owner picks its backend and prefilter where it runs
    if not index.nodes_loaded:
        raise QCGError(f"{index.path}: its node arrays were not loaded (QCGIndex.load(nodes=False))")
    if cluster is not None:
        from .ray_backend import RayBackend

        return RayBackend(index, cluster, local_backend)
    return local_backend(index, config)


def ray_mode(mode: str, manifest: dict) -> str:
    """How retrieval on Ray splits the work over an index (``RayConfig.ray_mode``): shards or queries."""
    sharded = len(index_shards(manifest)) > 1
    if "derived_from" in manifest:  # an ablation's index, made in this process: the workers get it whole
        return "queries"
    if mode == "shards" and not sharded:
        raise QCGError("--ray-mode shards needs an index stored as several shards (build it with --shard-nodes N)")
    return "shards" if mode == "shards" or (mode == "auto" and sharded) else "queries"


def local_backend(index: QCGIndex, config: RetrievalConfig) -> Backend:
    """The in-process backend ``config`` names (numpy or torch); each Ray worker runs one too."""
    name = backend_name(config)
    if name == "torch":
        from .torch_backend import TorchBackend

        device = config.device or default_device()
        return TorchBackend(index, device, prefilter_kind(config, device) == "bf16")
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        kind = prefilter_kind(config, dim=index.dim)
        if kind == "bf16" and not cpu_has_amx():
            _warn_bf16_without_amx()
        return NumpyBackend(index, kind)
    raise QCGError(f"unknown retrieval backend {name!r}")


@functools.cache  # once a run, not once a method or sweep point
def _warn_bf16_without_amx() -> None:
    logger.warning(
        "--prefilter bf16 on a CPU without AMX: its bf16 GEMM runs at 0.15-0.6x float32 here "
        "(benchmarks/RESULTS.md), so retrieval is slower than with --prefilter auto or off (the results are equal)"
    )


class Retriever:
    """Batched QCG retrieval over one index. It reuses its work buffers between calls, so use one
    ``Retriever`` per thread (the Ray workers each hold their own)."""

    def __init__(self, index: QCGIndex | str | Path, config: RetrievalConfig | None = None, cluster=None):
        self.config = (config or RetrievalConfig()).validate()
        if self.config.device is not None:  # before any work: a wrong device fails in one line
            check_device(self.config.device, "--retrieval-device")
            if backend_name(self.config) == "numpy" and self.config.device != "cpu":
                raise QCGError(f"--retrieval-device {self.config.device}: the numpy backend runs on the CPU")
        self.index = index if isinstance(index, QCGIndex) else QCGIndex.load(index)
        self.backend = make_backend(self.index, self.config, cluster)

    def search(self, queries: np.ndarray, config: RetrievalConfig | None = None) -> RetrievalResult:
        config = fit_to_index((config or self.config).validate(), self.index)
        return self.backend.search(check_queries(queries, self.index.dim), config)


def fit_to_index(config: RetrievalConfig, index: QCGIndex) -> RetrievalConfig:
    """``config`` with n and top_k at most the index's nodes and chunks: a result has a column per seed
    or chunk the index can give, so ``--n 99999999999`` asks for no terabytes."""
    nodes = index.n_nodes if index.nodes_loaded else int(index.manifest["counts"]["nodes"])
    n, top_k = max(1, min(config.n, nodes)), max(1, min(config.top_k, index.n_chunks))
    return config if (n, top_k) == (config.n, config.top_k) else dataclasses.replace(config, n=n, top_k=top_k)


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

    queries = check_queries(queries, index.dim)
    return baseline_search(index, method, embedder, queries, fit_to_index(config.validate(), index))
