import json

import numpy as np
import pyarrow as pa
import pytest

from qcg_gpu import index_format
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import IndexWriter, check_writable, data_dir, load_array, read_manifest


def _write(out, value):
    writer = IndexWriter(out)
    writer.write_table("chunks", pa.table({"chunk_id": [0]}))
    writer.write_array("knn_indptr", np.array([value]))
    writer.commit({"note": value})


def test_commit_publishes_a_complete_index(tmp_path):
    out = tmp_path / "idx"
    _write(out, 1)
    manifest = read_manifest(out)
    assert manifest["format_version"] == index_format.FORMAT_VERSION
    assert set(manifest["files"]) == {"chunks.parquet", "knn_indptr.npy"}
    assert load_array(out, "knn_indptr").tolist() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]  # no temporary directories left


def test_failure_while_writing_keeps_the_previous_index(tmp_path, monkeypatch):
    out = tmp_path / "idx"
    _write(out, 1)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(index_format.np.lib.format, "write_array_header_1_0", crash)
    writer = IndexWriter(out)
    writer.write_table("chunks", pa.table({"chunk_id": [0]}))
    with pytest.raises(OSError):
        writer.write_array("knn_indptr", np.array([2]))
    writer.abort()
    monkeypatch.undo()
    assert read_manifest(out)["note"] == 1
    assert load_array(out, "knn_indptr").tolist() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]


def test_overwrite_publishes_a_new_version_and_keeps_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "idx"
    _write(out, 1)
    first = data_dir(out)
    _write(out, 2)
    assert read_manifest(out)["note"] == 2 and load_array(out, "knn_indptr").tolist() == [2]
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]
    assert load_array(first, "knn_indptr").tolist() == [1]  # a reader pinned to version 1 still reads it
    _write(out, 3)
    assert first.exists()  # superseded less than RETAIN_SECONDS ago: still there for its readers
    monkeypatch.setattr(index_format, "RETAIN_SECONDS", 0.0)
    _write(out, 4)
    assert not first.exists()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([data_dir(out).name, _previous(out)])


def _previous(out):
    return next(p.name for p in out.iterdir() if p.is_dir() and p != data_dir(out))


def test_format_1_index_is_read_and_replaced(tmp_path):
    out = tmp_path / "idx"
    out.mkdir()
    np.save(out / "knn_indptr.npy", np.array([7]))
    (out / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {}}))
    assert data_dir(out) == out and load_array(out, "knn_indptr").tolist() == [7]
    _write(out, 8)
    assert load_array(out, "knn_indptr").tolist() == [8]
    assert (out / "knn_indptr.npy").exists()  # the previous (format 1) version stays for its readers
    _write(out, 9)
    assert not (out / "knn_indptr.npy").exists()


def _killed_writer(out, value):
    """A process that starts writing a version of ``out`` and is killed before it commits."""
    import subprocess
    import sys

    code = (
        "import os, signal, numpy as np\n"
        "from qcg_gpu.index_format import IndexWriter\n"
        f"IndexWriter({str(out)!r}).write_array('knn_indptr', np.array([{value}]))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9


def test_killed_writer_leaves_nothing_visible_and_is_cleaned_up(tmp_path):
    out = tmp_path / "idx"
    _killed_writer(out, 1)  # a new index, never committed
    assert not out.exists()
    _write(out, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]
    _killed_writer(out, 3)  # a replacement, never committed
    orphans = [p for p in out.iterdir() if p.name.startswith("v-") and p.name != read_manifest(out)["data_dir"]]
    assert len(orphans) == 1 and load_array(out, "knn_indptr").tolist() == [2]
    _write(out, 4)
    assert not orphans[0].exists()  # a version never published whose writer is gone has no readers: dropped


def test_a_version_another_writer_is_still_writing_is_kept(tmp_path):
    """Two writers of one index (a rebuild beside an add): the first to publish leaves the other's
    unpublished version alone, and the other then publishes a complete index."""
    out = tmp_path / "idx"
    _write(out, 1)
    slow = IndexWriter(out)
    slow.write_table("chunks", pa.table({"chunk_id": [0]}))
    _write(out, 2)  # publishes, and drops what it may
    assert slow.data.exists()
    slow.write_array("knn_indptr", np.array([3]))
    slow.commit({"note": 3})
    assert load_array(out, "knn_indptr").tolist() == [3] and data_dir(out) == slow.data
    assert not (slow.data / index_format.WRITING).exists()
    new = tmp_path / "new"  # the same for two builds of a new index: each is assembled aside
    first = IndexWriter(new)
    _write(new, 5)
    assert first.root.exists()
    first.abort()


def test_a_rebuild_publishes_only_between_updates(tmp_path):
    """An update (add, remove, retry) holds the index's lock from reading it to publishing; a rebuild's
    commit waits for it, so neither publishes over a version the other has not seen being made."""
    import threading
    import time

    out = tmp_path / "idx"
    _write(out, 1)
    released = threading.Event()

    def update():
        with index_format.update_lock(out):
            with index_format.update_lock(out):  # re-entrant: an update's own commit takes it again
                time.sleep(1.0)
            released.set()

    holder = threading.Thread(target=update)
    holder.start()
    time.sleep(0.2)
    _write(out, 2)  # a rebuild's commit
    assert released.is_set()
    holder.join()
    assert load_array(out, "knn_indptr").tolist() == [2]


def test_refusals(tmp_path):
    out = tmp_path / "idx"
    _write(out, 1)
    with pytest.raises(QCGError, match="already exists"):
        check_writable(out, overwrite=False)
    check_writable(out, overwrite=True)
    stranger = tmp_path / "photos"
    stranger.mkdir()
    with pytest.raises(QCGError, match="not a qcg index"):
        check_writable(stranger, overwrite=True)
    with pytest.raises(QCGError, match="no manifest.json"):
        read_manifest(stranger)
    with pytest.raises(QCGError, match="missing knn_scores.npy"):
        load_array(out, "knn_scores")
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(QCGError, match="format 99"):
        read_manifest(out)
