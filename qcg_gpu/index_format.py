"""The on-disk index: ``manifest.json`` plus Parquet tables and .npy arrays in a version
directory it names (see README, "Index format").

Publishing is atomic and readers are never disturbed: a new version's files go into a fresh
``v-<id>/`` directory, and only then does ``manifest.json`` (replaced with one rename) point
to it. A reader that loaded a version keeps reading that version (its files stay for at least
RETAIN_SECONDS after it is superseded), so a rebuild next to running queries changes nothing
for them. A new index is assembled in a hidden sibling directory and renamed into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import QCGError

FORMAT_VERSION = 2  # 2: files in the version directory named by manifest["data_dir"]; 1: files next to the manifest
READABLE_VERSIONS = (1, 2)
RETAIN_SECONDS = 600.0  # a superseded version stays this long at least, for readers still using it
SUPERSEDED = ".superseded"
MANIFEST = "manifest.json"
TABLES = ("chunks", "pairs", "nodes")
ARRAYS = ("node_embeddings", "chunk_embeddings", "pair_embeddings", "knn_indptr", "knn_indices", "knn_scores")
# Rows per Parquet row group: fixed, so that a table written in parts (a sharded build) gives the
# same file, byte for byte, as the whole table.
ROW_GROUP_ROWS = 8192


@dataclass
class ArrayParts:
    """An array given as its row blocks in order, so that it is written without ever being whole."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: Iterable[np.ndarray]


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 4 MiB blocks."""
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


_held_locks: dict[tuple[str, int], int] = {}  # (index, thread) -> depth: update_lock is re-entrant per thread


@contextmanager
def update_lock(index: str | Path):
    """One writer of an index at a time (add, remove, retry, and a rebuild's publishing): a second
    waits instead of losing the first one's work. Re-entrant within a thread."""
    key = (str(Path(index).resolve()), threading.get_ident())
    if key in _held_locks:
        _held_locks[key] += 1
        try:
            yield
        finally:
            _held_locks[key] -= 1
        return
    with open(Path(index) / ".update.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _held_locks[key] = 1
        try:
            yield
        finally:
            del _held_locks[key]
            fcntl.flock(lock, fcntl.LOCK_UN)


WRITING = ".writing"  # held (flock) by the writer of an unpublished version for as long as it runs


def _being_written(version: Path) -> bool:
    """Whether a live process still writes this unpublished version (its lock dies with its process)."""
    try:
        with open(version / WRITING, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fh, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return True
    except OSError:  # no such directory any more, or unwritable: not ours to judge
        return False


class IndexWriter:
    """Writes the files of a new index version; :meth:`commit` publishes them, :meth:`abort` drops them."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.version = f"v-{uuid.uuid4().hex[:12]}"
        # replacing: the new version goes next to the live one; new: the whole index is assembled aside
        self.root = (
            self.out if (self.out / MANIFEST).exists() else self.out.with_name(f".{self.out.name}.tmp-{self.version}")
        )
        self.data = self.root / self.version
        self.data.mkdir(parents=True)
        self._writing = open(self.data / WRITING, "a")  # held until commit or abort
        fcntl.flock(self._writing, fcntl.LOCK_EX)  # another writer's clean-up leaves this version alone
        self.files: dict[str, str] = {}

    def write_table(self, name: str, table) -> None:
        """A table, whole (a pyarrow Table) or as its parts in order (an iterable of Tables, at least one)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = iter([table] if isinstance(table, pa.Table) else table)
        first = next(parts)
        with pq.ParquetWriter(self.data / f"{name}.parquet", first.schema, compression="zstd") as writer:
            pending = first.slice(0, 0)  # rows not yet in a row group
            for part in itertools.chain([first], parts):
                pending = pa.concat_tables([pending, part])
                while pending.num_rows >= ROW_GROUP_ROWS:
                    writer.write_table(pending.slice(0, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
                    pending = pending.slice(ROW_GROUP_ROWS)
            if pending.num_rows:
                writer.write_table(pending, row_group_size=ROW_GROUP_ROWS)
        self.files[f"{name}.parquet"] = file_sha256(self.data / f"{name}.parquet")

    def write_array(self, name: str, array: np.ndarray | ArrayParts) -> None:
        """An array, whole or as :class:`ArrayParts` (the same .npy file either way)."""
        if isinstance(array, np.ndarray):
            array = ArrayParts(array.shape, array.dtype, [array])
        header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": array.shape}
        with open(self.data / f"{name}.npy", "wb") as fh:
            np.lib.format.write_array_header_1_0(fh, header)
            rows = 0
            for part in array.parts:
                fh.write(np.ascontiguousarray(part, dtype=array.dtype).tobytes())
                rows += len(part)
        if rows != array.shape[0]:
            raise QCGError(f"{name}: {rows} rows written, {array.shape[0]} announced")
        self.files[f"{name}.npy"] = file_sha256(self.data / f"{name}.npy")

    def commit(self, manifest: dict) -> Path:
        if self.root == self.out:  # replacing a live index: not in the middle of another writer's update
            with update_lock(self.out):
                return self._publish(manifest)
        return self._publish(manifest)

    def _publish(self, manifest: dict) -> Path:
        manifest = {"format_version": FORMAT_VERSION, **manifest, "data_dir": self.version, "files": self.files}
        for name in self.files:
            _fsync(self.data / name)
        previous = _data_dir_name(self.root)
        staged = self.root / f".{MANIFEST}.{self.version}"
        with open(staged, "w") as fh:
            json.dump(manifest, fh, indent=2, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(staged, self.root / MANIFEST)  # the publishing step: one atomic rename
        if self.root != self.out:
            os.replace(self.root, self.out)
            for leftover in self.out.parent.glob(f".{self.out.name}.tmp-v-*"):  # of runs killed before publishing
                if not _being_written(leftover / leftover.name.split(".tmp-")[-1]):
                    shutil.rmtree(leftover, ignore_errors=True)
        if previous and previous != "." and (self.out / previous).is_dir():
            (self.out / previous / SUPERSEDED).touch()  # readers of it get RETAIN_SECONDS from now
        self._release()
        self._drop_old_versions(keep={self.version, previous})
        return self.out

    def _release(self) -> None:
        self._writing.close()  # closing drops the flock
        (self.out / self.version / WRITING).unlink(missing_ok=True)

    def _drop_old_versions(self, keep: set) -> None:
        """The policy for old versions: the live one and the one before it stay (readers that loaded it
        go on); older ones go once superseded RETAIN_SECONDS ago, and so do versions never published
        whose writer is gone (killed); a version another writer is still writing stays. Format-1 files
        at the top go once a format-2 version has replaced them twice."""
        now = time.time()
        for path in self.out.iterdir():
            if path.is_dir() and path.name.startswith("v-") and path.name not in keep:
                marker = path / SUPERSEDED
                if marker.exists():
                    stale = now - marker.stat().st_mtime >= RETAIN_SECONDS
                else:
                    stale = not _being_written(path)
                if stale:
                    shutil.rmtree(path, ignore_errors=True)
            elif path.is_file() and path.suffix in (".npy", ".parquet") and "." not in keep:
                path.unlink(missing_ok=True)

    def abort(self) -> None:
        self._writing.close()
        shutil.rmtree(self.data if self.root == self.out else self.root, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _data_dir_name(root: Path) -> str | None:
    """The version directory the live manifest names ("." for a format-1 index), None if none."""
    try:
        return json.loads((root / MANIFEST).read_text()).get("data_dir", ".")
    except (OSError, json.JSONDecodeError):
        return None


def data_dir(index: str | Path, manifest: dict | None = None) -> Path:
    """Where the files of an index version are: ``index`` is the index (its manifest names the
    version; pass ``manifest`` to pin the one already read) or a version directory itself."""
    index = Path(index)
    if not (index / MANIFEST).exists():
        return index
    return index / (manifest or read_manifest(index)).get("data_dir", ".")


def index_root(folder: str | Path) -> Path:
    """The index a folder belongs to: itself, or the index above it when it is a version directory
    (what ``qcg check`` takes, and so what a message should name)."""
    folder = Path(folder)
    is_version = folder.name.startswith("v-") and (folder.parent / MANIFEST).exists()
    return folder.parent if is_version else folder


def read_manifest(index: str | Path) -> dict:
    path = Path(index) / MANIFEST
    if not path.exists():
        raise QCGError(f"{index} is not a qcg index (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise QCGError(f"{path} is corrupt: {exc}") from exc
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise QCGError(
            f"{index} has index format {manifest.get('format_version')}; "
            f"this qcg-gpu reads formats {', '.join(map(str, READABLE_VERSIONS))}"
        )
    return manifest


def verify_file(index: str | Path, filename: str, manifest: dict) -> None:
    """Refuse a file whose sha256 differs from the one the writer recorded."""
    expected = manifest.get("files", {}).get(filename)
    path = data_dir(index, manifest) / filename
    if expected is None:
        raise QCGError(f"index {index}: {filename} is not listed in manifest.json")
    if not path.exists():
        raise QCGError(f"index {index} is missing {filename}")
    if file_sha256(path) != expected:
        raise QCGError(
            f"index {index}: {filename} does not match its checksum in manifest.json "
            f"(corrupt, or changed after it was written); run: qcg check {index}"
        )


def load_array(index: str | Path, name: str, mmap: bool = True, manifest: dict | None = None) -> np.ndarray:
    """An array of the index (memory-mapped); checked against the manifest's checksum when ``manifest`` is given."""
    path = data_dir(index, manifest) / f"{name}.npy"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    if manifest is not None:
        verify_file(index, path.name, manifest)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        root = index_root(index)
        raise QCGError(f"index {root}: {path.name} is unreadable ({exc}); run: qcg check {root}") from exc


def load_table(index: str | Path, name: str, manifest: dict | None = None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = data_dir(index, manifest) / f"{name}.parquet"
    if not path.exists():
        raise QCGError(f"index {index} is missing {path.name}")
    if manifest is not None:
        verify_file(index, path.name, manifest)
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        root = index_root(index)
        raise QCGError(f"index {root}: {path.name} is unreadable ({exc}); run: qcg check {root}") from exc


def csr_problems(indptr: np.ndarray, indices: np.ndarray, n_nodes: int) -> list[str]:
    """What is wrong with a kNN CSR over ``n_nodes`` nodes (empty when it is valid). O(edges)."""
    if indptr.ndim != 1 or len(indptr) != n_nodes + 1:
        return [f"knn_indptr has {len(indptr)} entries for {n_nodes} nodes (expected {n_nodes + 1})"]
    problems = []
    if indptr[0] != 0 or indptr[-1] != len(indices):
        problems.append(
            f"knn_indptr runs from {indptr[0]} to {indptr[-1]}, expected 0 to {len(indices)} (the edge count)"
        )
    elif (np.diff(indptr) < 0).any():
        problems.append("knn_indptr decreases")
    if len(indices) and (indices.min() < 0 or indices.max() >= n_nodes):
        problems.append(f"knn_indices holds node ids outside [0, {n_nodes})")
    elif not problems and len(indices):
        rows = np.repeat(np.arange(n_nodes), np.diff(indptr))
        if (rows == indices).any():
            problems.append("the kNN graph has self-loops")
    return problems
