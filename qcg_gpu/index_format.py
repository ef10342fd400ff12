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


def load_array(index: str | Path, name: str, mmap: bool = True) -> np.ndarray:
    path = Path(index) / f"{name}.npy"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)


def load_table(index: str | Path, name: str):
    import pyarrow.parquet as pq

    path = Path(index) / f"{name}.parquet"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    return pq.read_table(path)
