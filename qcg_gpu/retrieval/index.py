"""The arrays retrieval needs, loaded from an index directory."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import QCGError
from ..index_format import Shard, csr_problems, data_dir, index_shards, load_array, load_table, read_index_manifest


@dataclass
class QCGIndex:
    """The arrays retrieval needs, loaded from an index directory (embeddings memory-mapped)."""

    path: Path
    manifest: dict
    node_embeddings: np.ndarray  # (N, d) float32, unit rows
    knn_indptr: np.ndarray
    knn_indices: np.ndarray
    node_chunk: np.ndarray  # (N,) int64
    n_chunks: int

    verified: bool = False  # files were checked against the manifest's checksums (lazy reads are too)
    nodes_loaded: bool = True  # False: a Ray driver's view of a sharded index (its workers hold the nodes)
    data: Path | None = None  # the version directory loaded: later reads stay on it while a rebuild publishes another

    @classmethod
    def load(cls, path: str | Path, verify: bool = True, nodes: bool = True) -> QCGIndex:
        """Load an index; ``verify`` checks each file read against its sha256 in the manifest
        (a few seconds per GB) so a corrupt index is refused instead of answering wrongly. ``nodes=False``
        loads no node array (their shards' owners do: ``shard_backend``), only the manifest and, on use, tables."""
        path = Path(path)
        manifest = read_index_manifest(path)
        data = data_dir(path, manifest)
        if not nodes:
            dim, n_chunks = int(manifest["models"]["embedding_dim"]), int(manifest["counts"]["chunks"])
            none = np.zeros(0, np.int64)
            empty = np.zeros((0, dim), np.float32)
            return cls(
                path, manifest, empty, none, none, none, n_chunks, verified=verify, data=data, nodes_loaded=False
            )
        emb = load_array(data, "node_embeddings", manifest=manifest, verify=verify)
        if emb.dtype != np.float32:
            emb = emb.astype(np.float32)
        node_chunk = load_table(data, "nodes", manifest, verify).column("chunk_id").to_numpy().astype(np.int64)
        indptr = load_array(data, "knn_indptr", mmap=False, manifest=manifest, verify=verify)
        indices = load_array(data, "knn_indices", mmap=False, manifest=manifest, verify=verify)
        n, n_chunks = len(emb), int(manifest["counts"]["chunks"])
        # cheap structural checks always: the numba kernels index with these arrays unchecked
        problems = [] if emb.ndim == 2 else [f"node_embeddings has shape {emb.shape}"]
        problems += [f"{len(node_chunk)} nodes for {n} node embeddings"] if len(node_chunk) != n else []
        problems += csr_problems(indptr, indices, n) if not problems else []
        if len(node_chunk) and not problems and (node_chunk.min() < 0 or node_chunk.max() >= n_chunks):
            problems.append(f"nodes.parquet names chunks outside [0, {n_chunks})")
        if not problems and (row := first_non_finite_row(emb)) is not None:  # it would poison every bound
            problems.append(f"node_embeddings.npy row {row} holds NaN or infinite values")
        if problems:
            raise QCGError(f"index {path} is inconsistent: {'; '.join(problems)}; run: qcg check {path}")
        return cls(path, manifest, emb, indptr, indices, node_chunk, n_chunks, verified=verify, data=data)

    @property
    def shards(self) -> list[Shard]:
        """The node shards it is stored in (empty: stored whole)."""
        return index_shards(self.manifest)

    @property
    def dim(self) -> int:
        return self.node_embeddings.shape[1]

    @property
    def n_nodes(self) -> int:
        return len(self.node_embeddings)

    @functools.cached_property
    def chunks(self):
        """chunks.parquet as a pyarrow Table, read on first use."""
        return self.table("chunks")

    def table(self, name: str):
        """Another table of the index (pairs, chunks), checksum-verified like the index was."""
        return load_table(self.data or self.path, name, self.manifest, self.verified)

    def array(self, name: str) -> np.ndarray:
        """Another array of the index (chunk or pair embeddings), checksum-verified like the index was."""
        return load_array(self.data or self.path, name, manifest=self.manifest, verify=self.verified)

    def embedder(self, device: str | None = None):
        """The embedder the index was built with (an :class:`embedding.Embedder`), treating long texts
        as its build did."""
        from ..config import IndexConfig
        from ..embedding import Embedder
        from ..models import DEFAULT_EMBEDDER

        name = self.manifest["models"]["embedder"]
        long_texts = IndexConfig.from_dict(self.manifest["settings"]).nodes.long_texts
        return Embedder(None if name == DEFAULT_EMBEDDER else name, device, long_texts=long_texts)

    def chunk_texts(self) -> list[str]:
        return self.chunks.column("text").to_pylist()


def first_non_finite_row(array: np.ndarray, rows: int = 65536) -> int | None:
    """The first row holding NaN or an infinity (in blocks: a memory map is read once, never whole)."""
    for start in range(0, len(array), rows):
        finite = np.isfinite(array[start : start + rows]).all(axis=1)
        if not finite.all():
            return start + int(np.argmin(finite))
    return None
