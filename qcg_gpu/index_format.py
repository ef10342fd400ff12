"""The on-disk index: Parquet tables, .npy arrays and manifest.json (see README, "Index format").

Writing is atomic: everything goes into a hidden sibling directory, the
manifest is written last, and the directory is renamed into place. A reader
therefore sees either the previous complete index or the new complete one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np

from .errors import QCGError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TABLES = ("chunks", "pairs", "nodes")
ARRAYS = ("node_embeddings", "chunk_embeddings", "pair_embeddings", "knn_indptr", "knn_indices", "knn_scores")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check_writable(out: Path, overwrite: bool) -> None:
    """Fail before any work is done if the index could not be written at the end."""
    if out.exists() and not overwrite:
        raise QCGError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not (out / MANIFEST).exists():
        raise QCGError(f"{out} exists and is not a qcg index; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise QCGError(f"cannot write to {out.parent}")


class IndexWriter:
    """Collects the files of an index in a temporary directory; :meth:`commit` publishes them."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}")
        self.tmp.mkdir(parents=True)
        self.files: dict[str, str] = {}

    def write_table(self, name: str, table) -> None:
        import pyarrow.parquet as pq

        pq.write_table(table, self.tmp / f"{name}.parquet", compression="zstd")
        self.files[f"{name}.parquet"] = _sha256(self.tmp / f"{name}.parquet")

    def write_array(self, name: str, array: np.ndarray) -> None:
        np.save(self.tmp / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        self.files[f"{name}.npy"] = _sha256(self.tmp / f"{name}.npy")

    def commit(self, manifest: dict) -> Path:
        manifest = {"format_version": FORMAT_VERSION, **manifest, "files": self.files}
        with open(self.tmp / MANIFEST, "w") as fh:
            json.dump(manifest, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(self.out, old)
        os.replace(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def read_manifest(index: str | Path) -> dict:
    path = Path(index) / MANIFEST
    if not path.exists():
        raise QCGError(f"{index} is not a qcg index (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QCGError(f"{path} is corrupt: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise QCGError(f"{index} has index format {manifest.get('format_version')}; this qcg-gpu reads format {FORMAT_VERSION}")
    return manifest


def verify_file(index: str | Path, filename: str, manifest: dict) -> None:
    """Refuse a file whose sha256 differs from the one the writer recorded."""
    expected = manifest.get("files", {}).get(filename)
    path = Path(index) / filename
    if expected is None:
        raise QCGError(f"index {index}: {filename} is not listed in manifest.json")
    if not path.exists():
        raise QCGError(f"index {index} is missing {filename}")
    if _sha256(path) != expected:
        raise QCGError(f"index {index}: {filename} does not match its checksum in manifest.json "
                       f"(corrupt, or changed after it was written); run: qcg check {index}")


def load_array(index: str | Path, name: str, mmap: bool = True, manifest: dict | None = None) -> np.ndarray:
    """An array of the index (memory-mapped); checked against the manifest's checksum when ``manifest`` is given."""
    path = Path(index) / f"{name}.npy"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    if manifest is not None:
        verify_file(index, path.name, manifest)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise QCGError(f"index {index}: {path.name} is unreadable ({exc}); run: qcg check {index}") from exc


def load_table(index: str | Path, name: str, manifest: dict | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(index) / f"{name}.parquet"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    if manifest is not None:
        verify_file(index, path.name, manifest)
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise QCGError(f"index {index}: {path.name} is unreadable ({exc}); run: qcg check {index}") from exc


def csr_problems(indptr: np.ndarray, indices: np.ndarray, n_nodes: int) -> list[str]:
    """What is wrong with a kNN CSR over ``n_nodes`` nodes (empty when it is valid). O(edges)."""
    if indptr.ndim != 1 or len(indptr) != n_nodes + 1:
        return [f"knn_indptr has {len(indptr)} entries for {n_nodes} nodes (expected {n_nodes + 1})"]
    problems = []
    if indptr[0] != 0 or indptr[-1] != len(indices):
        problems.append(f"knn_indptr runs from {indptr[0]} to {indptr[-1]}, expected 0 to {len(indices)} (the edge count)")
    elif (np.diff(indptr) < 0).any():
        problems.append("knn_indptr decreases")
    if len(indices) and (indices.min() < 0 or indices.max() >= n_nodes):
        problems.append(f"knn_indices holds node ids outside [0, {n_nodes})")
    elif not problems and len(indices):
        rows = np.repeat(np.arange(n_nodes), np.diff(indptr))
        if (rows == indices).any():
            problems.append("the kNN graph has self-loops")
    return problems
