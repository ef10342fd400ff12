import json

import numpy as np
import pyarrow as pa
import pytest

from qcg_gpu import index_format
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import IndexWriter, check_writable, load_array, read_manifest


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

    monkeypatch.setattr(index_format.np, "save", crash)
    writer = IndexWriter(out)
    writer.write_table("chunks", pa.table({"chunk_id": [0]}))
    with pytest.raises(OSError):
        writer.write_array("knn_indptr", np.array([2]))
    writer.abort()
    monkeypatch.undo()
    assert read_manifest(out)["note"] == 1
    assert load_array(out, "knn_indptr").tolist() == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]


def test_overwrite_replaces_atomically(tmp_path):
    out = tmp_path / "idx"
    _write(out, 1)
    _write(out, 2)
    assert read_manifest(out)["note"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]


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
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(QCGError, match="format 99"):
        read_manifest(out)
    with pytest.raises(QCGError, match="missing knn_scores.npy"):
        load_array(out, "knn_scores")
