"""The on-disk index: ``manifest.json`` plus Parquet tables and .npy arrays in a version
directory it names (see docs/index-format.md).

A large index is stored as node shards (``--shard-nodes``): each shard holds a range of node ids
(their embeddings, node table rows and kNN rows) and the chunks and pairs those nodes belong to, in
``shards/NAME/`` with the same file names. Ids stay global, a shard is cut only at a chunk boundary,
and the manifest lists the shards with every file's checksum. A Ray worker loads only its shards
(:func:`load_shard_array`); the readers of whole arrays and tables join the shards.

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
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .errors import QCGError

FORMAT_VERSION = 2  # 2: files in the version directory named by manifest["data_dir"]; 1: files next to the manifest
SHARDED_FORMAT_VERSION = 3  # 3: as 2, the files split into the node shards manifest["shards"] lists
READABLE_VERSIONS = (1, 2, 3)
RETAIN_SECONDS = 600.0  # a superseded version stays this long at least, for readers still using it
SUPERSEDED = ".superseded"
MANIFEST = "manifest.json"
TABLES = ("chunks", "pairs", "nodes")
ARRAYS = ("node_embeddings", "chunk_embeddings", "pair_embeddings", "knn_indptr", "knn_indices", "knn_scores")
GRAPH_ARRAYS = ("knn_indptr", "knn_indices", "knn_scores")  # a shard's kNN rows: local indptr, global node ids
ROWS_OF = {  # the id space whose range a shard holds of each table and embedding array
    "nodes": "nodes",
    "node_embeddings": "nodes",
    "chunks": "chunks",
    "chunk_embeddings": "chunks",
    "pairs": "pairs",
    "pair_embeddings": "pairs",
}
# Rows per Parquet row group: fixed, so that a table written in parts (a sharded build) gives the
# same file, byte for byte, as the whole table.
ROW_GROUP_ROWS = 8192


@dataclass
class ArrayParts:
    """An array given as its row blocks in order, so that it is written without ever being whole."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: Iterable[np.ndarray]


@dataclass(frozen=True)
class Shard:
    """One node shard: the half-open ranges of global node, chunk and pair ids its files hold."""

    name: str
    nodes: tuple[int, int]
    chunks: tuple[int, int]
    pairs: tuple[int, int] = (0, 0)

    def file(self, filename: str) -> str:
        """The path of one of its files, relative to the version directory."""
        return f"shards/{self.name}/{filename}"

    def rows(self, space: str) -> tuple[int, int]:
        return getattr(self, space)

    def to_dict(self) -> dict:
        return {"name": self.name, "nodes": list(self.nodes), "chunks": list(self.chunks), "pairs": list(self.pairs)}

    @classmethod
    def from_dict(cls, entry: dict) -> Shard:
        try:
            nodes, chunks, pairs = ((int(entry[k][0]), int(entry[k][1])) for k in ("nodes", "chunks", "pairs"))
            shard = cls(str(entry["name"]), nodes, chunks, pairs)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise QCGError(f"manifest.json lists a malformed shard: {entry!r}") from exc
        if not shard.name.isalnum():
            raise QCGError(f"manifest.json names a shard {shard.name!r}: shard names are letters and digits")
        return shard


def plan_shards(node_chunk: np.ndarray, n_chunks: int, shard_nodes: int | None) -> list[Shard]:
    """Shards of at most ``shard_nodes`` nodes each (a chunk with more nodes gets a shard of its own),
    cut only between chunks; ``node_chunk`` must not decrease (nodes are stored chunk by chunk).
    One shard when ``shard_nodes`` is None or the nodes fit in one. Pair ranges are set as the pairs
    table is written."""
    if shard_nodes is not None and shard_nodes < 1:
        raise QCGError(f"--shard-nodes must be >= 1, got {shard_nodes}")
    n_nodes = len(node_chunk)
    if len(node_chunk) and (np.diff(node_chunk) < 0).any():
        raise QCGError("nodes are not stored chunk by chunk, so they cannot be cut into shards at chunk boundaries")
    if shard_nodes is None or n_nodes <= shard_nodes:
        return [Shard("00000", (0, n_nodes), (0, n_chunks))]
    starts = np.searchsorted(node_chunk, np.arange(n_chunks + 1))  # starts[c]: chunk c's first node
    shards: list[Shard] = []
    chunk = 0
    while chunk < n_chunks:
        lo = int(starts[chunk])
        end = int(np.searchsorted(starts, lo + shard_nodes, side="right")) - 1  # the last boundary that fits
        if end <= chunk:  # the chunk alone holds more than shard_nodes nodes
            end = int(np.searchsorted(starts, lo, side="right"))
        end = min(end, n_chunks)
        shards.append(Shard(f"{len(shards):05d}", (lo, int(starts[end])), (chunk, end)))
        chunk = end
    return shards


def plan_added_shards(old: list[Shard], node_chunk: np.ndarray, n_chunks: int, shard_nodes: int | None) -> list[Shard]:
    """The shards of nodes added after the ``old`` shards (``node_chunk``: global chunk ids, ``n_chunks``:
    the chunk count after the add), cut as :func:`plan_shards` cuts, numbered and named after them."""
    first_node, first_chunk = old[-1].nodes[1], old[-1].chunks[1]
    planned = plan_shards(np.asarray(node_chunk) - first_chunk, n_chunks - first_chunk, shard_nodes)
    added = [
        Shard(
            f"{len(old) + i:05d}",
            (first_node + s.nodes[0], first_node + s.nodes[1]),
            (first_chunk + s.chunks[0], first_chunk + s.chunks[1]),
        )
        for i, s in enumerate(planned)
    ]
    if {s.name for s in old} & {s.name for s in added}:
        raise QCGError(f"the index's shards are not named 00000 to {len(old) - 1:05d}: cannot name new ones")
    return added


def index_shards(manifest: dict) -> list[Shard]:
    """The shards a manifest lists; empty for an index stored whole."""
    return [Shard.from_dict(entry) for entry in manifest.get("shards", [])]


def expected_files(manifest: dict) -> list[str]:
    """Every file the index must hold, relative to its version directory."""
    names = [f"{t}.parquet" for t in TABLES] + [f"{a}.npy" for a in ARRAYS]
    shards = index_shards(manifest)
    return [shard.file(name) for shard in shards for name in names] if shards else names


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def check_writable(out: Path, overwrite: bool) -> str | None:
    """Fail before any work is done if the index could not be written at the end. Returns the live
    version it would replace (None: a new index), for :class:`IndexWriter`'s ``replaces``."""
    if out.exists() and not overwrite:
        raise QCGError(f"{out} already exists; pass --overwrite to replace it")
    if out.exists() and not (out / MANIFEST).exists():
        raise QCGError(f"{out} exists and is not a qcg index; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):  # a real write: /proc and read-only mounts pass os.access
            pass
    except OSError as exc:
        raise QCGError(f"cannot write the index at {out}: {exc.strerror or exc}") from exc
    return _data_dir_name(out)


ANY_VERSION = "any"  # IndexWriter(replaces=...): publish over whatever is live (its caller holds update_lock)


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

    def __init__(self, out: str | Path, shards: list[Shard] | None = None, replaces: str | None = ANY_VERSION):
        """``shards`` (:func:`plan_shards`): store the files split into these node shards; None or one
        shard: whole, as format 2. ``replaces``: the live version when the work began (None: no index
        yet; :func:`check_writable`); if another writer published since, :meth:`commit` refuses."""
        self.out, self.replaces = Path(out), replaces
        self.shards = shards if shards and len(shards) > 1 else None
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

    def write_table(self, name: str, table, from_shard: int = 0) -> None:
        """A table, whole (a pyarrow Table) or as its parts in order (an iterable of Tables, at least one).
        ``from_shard``: the rows are those of this shard and the ones after it (an add writes its new shards
        only; the shards before are reused, :meth:`reuse_file`)."""
        import pyarrow as pa

        parts = iter([table] if isinstance(table, pa.Table) else table)
        first = next(parts)
        if self.shards is None:
            with self._parquet(f"{name}.parquet", first.schema) as file:
                for part in itertools.chain([first], parts):
                    file.add(part)
            return
        # rows go to the shard holding their chunk (tables are in chunk order): one shard file open at a time
        starts = np.array([s.chunks[0] for s in self.shards[from_shard + 1 :]])
        counts = [0] * len(self.shards)
        current = from_shard
        file = self._parquet(self.shards[current].file(f"{name}.parquet"), first.schema)
        for part in itertools.chain([first], parts):
            owner = from_shard + np.searchsorted(starts, part.column("chunk_id").to_numpy(), side="right")
            if (np.diff(owner) < 0).any() or (len(owner) and owner[0] < current):
                file.close()
                raise QCGError(f"{name} rows are not in chunk order: they cannot be stored as shards")
            for s in np.unique(owner):
                while current < s:  # the shards before it are complete (or hold no row of this table)
                    file.close()
                    current += 1
                    file = self._parquet(self.shards[current].file(f"{name}.parquet"), first.schema)
                rows = np.flatnonzero(owner == s)
                file.add(part.slice(int(rows[0]), len(rows)))
                counts[s] += len(rows)
        file.close()
        for shard in self.shards[current + 1 :]:
            self._parquet(shard.file(f"{name}.parquet"), first.schema).close()
        if name == "pairs":
            first_pair = self.shards[from_shard - 1].pairs[1] if from_shard else 0
            ends = (first_pair + np.cumsum(counts[from_shard:])).tolist()
            self.shards = self.shards[:from_shard] + [
                replace(s, pairs=(e - c, e)) for s, c, e in zip(self.shards[from_shard:], counts[from_shard:], ends)
            ]

    def _parquet(self, filename: str, schema) -> _ParquetFile:
        return _ParquetFile(self, filename, schema)

    def write_array(self, name: str, array: np.ndarray | ArrayParts, from_shard: int = 0) -> None:
        """An array, whole or as :class:`ArrayParts` (the same .npy file either way); in a sharded index, each
        shard's rows of it (an embedding array: ``ROWS_OF`` names its id space), from shard ``from_shard``
        on (:meth:`write_table`)."""
        if isinstance(array, np.ndarray):
            array = ArrayParts(array.shape, array.dtype, [array])
        if self.shards is None or name not in ROWS_OF:
            self._write_npy(f"{name}.npy", array)
            return
        shards = self.shards[from_shard:]
        bounds = [shard.rows(ROWS_OF[name]) for shard in shards]
        if bounds[-1][1] - bounds[0][0] != array.shape[0]:
            raise QCGError(f"{name}: {array.shape[0]} rows, the shards hold {bounds[-1][1] - bounds[0][0]}")
        blocks = RowBlocks(iter(array.parts))
        for shard, (lo, hi) in zip(shards, bounds):
            shape = (hi - lo, *array.shape[1:])
            self._write_npy(shard.file(f"{name}.npy"), ArrayParts(shape, array.dtype, blocks.take(hi - lo)))

    def write_graph(self, indptr: np.ndarray, indices: np.ndarray, scores: np.ndarray) -> None:
        """The kNN CSR; in a sharded index, each shard's rows (its indptr from 0, node ids global)."""
        if self.shards is None:
            for name, array in zip(GRAPH_ARRAYS, (indptr, indices, scores)):
                self._write_npy(f"{name}.npy", array)
            return
        for i, shard in enumerate(self.shards):
            lo, hi = shard.nodes
            first, last = int(indptr[lo]), int(indptr[hi])
            self.write_shard_graph(i, np.asarray(indptr[lo : hi + 1]) - first, indices[first:last], scores[first:last])

    def reuse_file(self, source: Path, filename: str, sha256: str) -> None:
        """A file of a published version, unchanged, as ``filename`` of this one (checksum ``sha256``, as
        that version's manifest lists it): hard-linked where the file system allows (no bytes copied; no
        writer ever changes a published file), else copied."""
        path = self.data / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, path)
        except OSError:
            shutil.copyfile(source, path)
        self.files[filename] = sha256

    def write_shard_graph(self, shard: int, indptr: np.ndarray, indices: np.ndarray, scores: np.ndarray) -> None:
        """Shard ``shard``'s kNN rows (indptr from 0, global node ids), as soon as they are ranked."""
        assert self.shards is not None, "a graph of one shard is written whole (write_graph)"
        for name, array in zip(GRAPH_ARRAYS, (indptr, indices, scores)):
            self._write_npy(self.shards[shard].file(f"{name}.npy"), array)

    def _write_npy(self, filename: str, array: np.ndarray | ArrayParts) -> None:
        if isinstance(array, np.ndarray):
            array = ArrayParts(array.shape, array.dtype, [array])
        header = {"descr": np.lib.format.dtype_to_descr(array.dtype), "fortran_order": False, "shape": array.shape}
        path = self.data / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as fh:
            np.lib.format.write_array_header_1_0(fh, header)
            rows = 0
            for part in array.parts:
                fh.write(np.ascontiguousarray(part, dtype=array.dtype).tobytes())
                rows += len(part)
        if rows != array.shape[0]:
            raise QCGError(f"{filename}: {rows} rows written, {array.shape[0]} announced")
        self.files[filename] = file_sha256(path)

    def commit(self, manifest: dict) -> Path:
        if self.root == self.out:  # replacing a live index: not in the middle of another writer's update
            with update_lock(self.out):
                self._check_unchanged()
                return self._publish(manifest)
        return self._publish(manifest)

    def _check_unchanged(self) -> None:
        """Refuse to publish over a version another writer published while this one worked (an index add
        during a rebuild): its work would be dropped without a word."""
        live = _data_dir_name(self.out)
        if self.replaces != ANY_VERSION and live != self.replaces:
            self.abort()
            raise QCGError(
                f"{self.out} changed while this build ran: another writer published {live} over "
                f"{self.replaces or 'nothing'} (an index add, remove or build); nothing was published, so that "
                "writer's work stays live. Run again (generated replies are cached)"
            )

    def _publish(self, manifest: dict) -> Path:
        manifest = {"format_version": FORMAT_VERSION, **manifest, "data_dir": self.version, "files": self.files}
        manifest.pop("shards", None)
        if self.shards is not None:
            manifest |= {"format_version": SHARDED_FORMAT_VERSION, "shards": [s.to_dict() for s in self.shards]}
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
            try:
                os.replace(self.root, self.out)
            except OSError as exc:  # another build made OUT since this one began
                if not (self.out / MANIFEST).exists():
                    raise
                self.abort()
                raise QCGError(
                    f"{self.out} was created by another build while this one ran; nothing was published, so "
                    "that build's index stays. Pass --overwrite to replace it"
                ) from exc
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


class _ParquetFile:
    """One Parquet file of a writer, written in fixed row groups (``ROW_GROUP_ROWS``) whatever the parts."""

    def __init__(self, writer: IndexWriter, filename: str, schema):
        import pyarrow.parquet as pq

        self.writer, self.filename, self.path = writer, filename, writer.data / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = pq.ParquetWriter(self.path, schema, compression="zstd")
        self.pending = schema.empty_table()  # rows not yet in a row group

    def add(self, part) -> None:
        import pyarrow as pa

        self.pending = pa.concat_tables([self.pending, part])
        while self.pending.num_rows >= ROW_GROUP_ROWS:
            self.file.write_table(self.pending.slice(0, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
            self.pending = self.pending.slice(ROW_GROUP_ROWS)

    def close(self) -> None:
        if self.pending.num_rows:
            self.file.write_table(self.pending, row_group_size=ROW_GROUP_ROWS)
        self.file.close()
        self.writer.files[self.filename] = file_sha256(self.path)

    def __enter__(self) -> _ParquetFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RowBlocks:
    """Rows of a stream of row blocks, handed out ``take(n)`` rows at a time as lists of blocks."""

    def __init__(self, parts):
        self.parts, self.rest = parts, None

    def take(self, n: int) -> list[np.ndarray]:
        out = []
        while n > 0:
            if self.rest is None or not len(self.rest):
                self.rest = next(self.parts)
                continue
            out.append(self.rest[:n])
            n -= len(out[-1])
            self.rest = self.rest[len(out[-1]) :]
        return out


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
    name = (manifest or read_manifest(index)).get("data_dir", ".")
    if not isinstance(name, str) or not _inside(name):
        raise QCGError(f"index {index}: manifest.json names data_dir {name!r}, which is not a folder of the index")
    return index / name


def _inside(name: str) -> bool:
    """Whether a path the manifest names stays inside the folder it is relative to."""
    path = Path(name)
    return not path.is_absolute() and ".." not in path.parts


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
    if not isinstance(manifest, dict):
        raise QCGError(f"{path} is corrupt: a JSON object was expected, not a {type(manifest).__name__}")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise QCGError(
            f"{index} has index format {manifest.get('format_version')}; "
            f"this qcg-gpu reads formats {', '.join(map(str, READABLE_VERSIONS))}"
        )
    return manifest


# What an index's readers take from its manifest besides its files: {section: keys}.
MANIFEST_SECTIONS = {"settings": (), "models": ("embedder", "embedding_dim"), "counts": ("chunks", "nodes")}


def manifest_problems(manifest: dict) -> list[str]:
    """The sections and keys readers need that a (hand-edited) manifest lacks."""
    problems = []
    for section, keys in MANIFEST_SECTIONS.items():
        if not isinstance(manifest.get(section), dict):
            problems.append(f"{MANIFEST} has no {section!r} object")
        else:
            problems += [f"{MANIFEST} has no {section}.{key}" for key in keys if key not in manifest[section]]
    return problems


def read_index_manifest(index: str | Path) -> dict:
    """:func:`read_manifest`, refusing in one line a manifest without what an index's readers take from it."""
    manifest = read_manifest(index)
    if problems := manifest_problems(manifest):
        raise QCGError(f"index {index} is corrupt: {'; '.join(problems)}")
    return manifest


def verify_file(index: str | Path, filename: str, manifest: dict) -> None:
    """Refuse a file whose sha256 differs from the one the writer recorded."""
    expected = manifest.get("files", {}).get(filename)
    root = index_root(index)  # what qcg check takes, whether ``index`` is the index or its version directory
    if not _inside(filename):
        raise QCGError(f"index {root}: manifest.json lists {filename!r}, which is not a file of the index")
    path = data_dir(index, manifest) / filename
    if expected is None:
        raise QCGError(f"index {root}: {filename} is not listed in manifest.json")
    if not path.exists():
        raise QCGError(f"index {root} is missing {filename}")
    if file_sha256(path) != expected:
        raise QCGError(
            f"index {root}: {filename} does not match its checksum in manifest.json "
            f"(corrupt, or changed after it was written); run: qcg check {index_root(index)}"
        )


def _layout(index: str | Path, manifest: dict | None) -> dict | None:
    """The manifest that says how ``index``'s files are laid out: the one given, else the index's own
    (None for a bare version directory, which is stored whole)."""
    if manifest is not None:
        return manifest
    return read_manifest(index) if (Path(index) / MANIFEST).exists() else None


def load_array(
    index: str | Path, name: str, mmap: bool = True, manifest: dict | None = None, verify: bool | None = None
) -> np.ndarray:
    """An array of the index, memory-mapped when it is stored whole (a sharded index's shards are joined in
    memory); checked against the manifest's checksums when ``verify`` (default: when ``manifest`` is given)."""
    verify = manifest is not None if verify is None else verify
    layout = _layout(index, manifest)
    shards = index_shards(layout) if layout else []
    if shards:
        parts = [load_shard_array(index, layout, shard, name, mmap, verify) for shard in shards]  # type: ignore[arg-type]
        return join_indptr(parts) if name == "knn_indptr" else np.concatenate(parts)
    return _load_npy(index, f"{name}.npy", mmap, layout if verify else None)


def join_indptr(parts: list[np.ndarray]) -> np.ndarray:
    """Consecutive shards' CSR indptrs (each from 0) as the indptr of their rows together."""
    offsets = np.cumsum([0] + [int(p[-1]) for p in parts])
    return np.concatenate([[0]] + [p[1:] + offset for p, offset in zip(parts, offsets)]).astype(parts[0].dtype)


def load_shard_array(
    index: str | Path, manifest: dict, shard: Shard, name: str, mmap: bool = True, verify: bool = True
) -> np.ndarray:
    """One shard's rows of an array (a kNN array: its rows' CSR, indptr from 0)."""
    return _load_npy(index, shard.file(f"{name}.npy"), mmap, manifest if verify else None, manifest)


def read_shard_rows(index: str | Path, manifest: dict, shards: list[Shard], name: str, verify: bool = True):
    """Consecutive shards' rows of an embedding array, read straight into one array (no second copy)."""
    parts = [load_shard_array(index, manifest, s, name, mmap=True, verify=verify) for s in shards]
    out = np.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
    row = 0
    for shard, part in zip(shards, parts):
        with open(data_dir(index, manifest) / shard.file(f"{name}.npy"), "rb") as fh:
            # past the header, the rows are read into place (the memory map gave their shape alone)
            if np.lib.format.read_magic(fh) == (1, 0):
                np.lib.format.read_array_header_1_0(fh)
            else:
                np.lib.format.read_array_header_2_0(fh)
            fh.readinto(out[row : row + len(part)].data.cast("B"))
        row += len(part)
    return out


def _load_npy(index, filename: str, mmap: bool, checked: dict | None, layout: dict | None = None) -> np.ndarray:
    path = data_dir(index, checked or layout) / filename
    if not path.exists():
        raise QCGError(f"index {index_root(index)} is missing {filename}")
    if checked is not None:
        verify_file(index, filename, checked)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        root = index_root(index)
        raise QCGError(f"index {root}: {filename} is unreadable ({exc}); run: qcg check {root}") from exc


def load_table(index: str | Path, name: str, manifest: dict | None = None, verify: bool | None = None, columns=None):
    """A table of the index (a sharded index's shards joined), or only its ``columns``; checksums checked as
    :func:`load_array` does."""
    import pyarrow as pa

    verify = manifest is not None if verify is None else verify
    layout = _layout(index, manifest)
    shards = index_shards(layout) if layout else []
    files = [s.file(f"{name}.parquet") for s in shards] or [f"{name}.parquet"]
    return pa.concat_tables([_load_parquet(index, f, layout if verify else None, layout, columns) for f in files])


def load_shard_table(index: str | Path, manifest: dict, shard: Shard, name: str, verify: bool = True):
    """One shard's rows of a table."""
    return _load_parquet(index, shard.file(f"{name}.parquet"), manifest if verify else None, manifest)


def _load_parquet(index, filename: str, checked: dict | None, layout: dict | None, columns=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = data_dir(index, checked or layout) / filename
    if not path.exists():
        raise QCGError(f"index {index_root(index)} is missing {filename}")
    if checked is not None:
        verify_file(index, filename, checked)
    root = index_root(index)
    try:
        # Read through Python (audit hooks see the file opened: ``shard_backend.ShardActor``) into memory
        # Arrow owns: an Arrow thread that drops the last reference to a Python file or buffer takes the
        # GIL, and at interpreter exit that aborts the process ("terminate called without an active
        # exception", status 134; seen in one reader in ten under load)
        with open(path, "rb") as fh:
            data = pa.allocate_buffer(os.fstat(fh.fileno()).st_size)
            if fh.readinto(memoryview(data)) != data.size:
                raise OSError("the file changed size while it was read")
        return pq.read_table(pa.BufferReader(data), columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise QCGError(f"index {root}: {filename} is unreadable ({exc}); run: qcg check {root}") from exc


def csr_problems(
    indptr: np.ndarray, indices: np.ndarray, n_nodes: int, n_targets: int | None = None, first_row: int = 0
) -> list[str]:
    """What is wrong with a kNN CSR of ``n_nodes`` rows (node ids from ``first_row``: a shard's) over
    ``n_targets`` nodes (default ``n_nodes``); empty when it is valid. O(edges)."""
    n_targets = n_nodes if n_targets is None else n_targets
    if indptr.ndim != 1 or len(indptr) != n_nodes + 1:
        return [f"knn_indptr has {len(indptr)} entries for {n_nodes} nodes (expected {n_nodes + 1})"]
    problems = []
    if indptr[0] != 0 or indptr[-1] != len(indices):
        problems.append(
            f"knn_indptr runs from {indptr[0]} to {indptr[-1]}, expected 0 to {len(indices)} (the edge count)"
        )
    elif (np.diff(indptr) < 0).any():
        problems.append("knn_indptr decreases")
    if len(indices) and (indices.min() < 0 or indices.max() >= n_targets):
        problems.append(f"knn_indices holds node ids outside [0, {n_targets})")
    elif not problems and len(indices):
        rows = first_row + np.repeat(np.arange(n_nodes), np.diff(indptr))
        if (rows == indices).any():
            problems.append("the kNN graph has self-loops")
    return problems
