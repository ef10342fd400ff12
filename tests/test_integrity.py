"""Index integrity: qcg check finds corruption, and loading refuses a corrupt or inconsistent index
with a clear message (real index files, damaged the way disks and hand edits damage them)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from qcg_gpu import build_index
from qcg_gpu.config import IndexConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import data_dir, file_sha256
from qcg_gpu.integrity import check_index
from qcg_gpu.retrieval import QCGIndex

from .conftest import sample_docs


@pytest.fixture(scope="module")
def sound_index(tmp_path_factory, embedder):
    """A real sentence-node index (no LLM needed) of four LiHuaWorld chat logs."""
    root = tmp_path_factory.mktemp("integrity")
    docs = sample_docs(root / "docs", 4)
    config = IndexConfig()
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    build_index(docs, root / "index", config, embedder=embedder)
    return root / "index"


@pytest.fixture
def index(sound_index, tmp_path):
    copy = tmp_path / "index"
    shutil.copytree(sound_index, copy)
    return copy


def _rewrite(index, name: str, array: np.ndarray) -> None:
    """Replace an array and record its new checksum: a consistent-looking but wrong index (a bad hand edit)."""
    np.save(data_dir(index) / f"{name}.npy", array)
    manifest = json.loads((index / "manifest.json").read_text())
    manifest["files"][f"{name}.npy"] = file_sha256(data_dir(index) / f"{name}.npy")
    (index / "manifest.json").write_text(json.dumps(manifest))


def test_sound_index_passes(index, cli):
    assert check_index(index) == []
    result = cli("check", index)
    assert result.returncode == 0 and "sound" in result.stdout


def test_flipped_byte_is_found_and_refused(index, cli):
    path = data_dir(index) / "node_embeddings.npy"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit in the last embedding
    path.write_bytes(bytes(data))
    problems = check_index(index)
    assert len(problems) == 1 and "node_embeddings.npy does not match its checksum" in problems[0]
    result = cli("check", index)
    assert result.returncode == 1 and "PROBLEM" in result.stdout
    result = cli("query", index, "--query", "house rules", "--gamma", "1.0")
    assert result.returncode == 2 and "does not match its checksum" in result.stderr and "qcg check" in result.stderr
    assert QCGIndex.load(index, verify=False).node_embeddings.shape[0] > 0  # opting out of verification still loads


def test_truncated_file_is_refused(index):
    path = data_dir(index) / "knn_indices.npy"
    path.write_bytes(path.read_bytes()[:100])
    assert any("knn_indices.npy" in p for p in check_index(index))
    with pytest.raises(QCGError, match="knn_indices.npy is unreadable") as refused:
        QCGIndex.load(index, verify=False)
    assert str(refused.value).endswith(f"run: qcg check {index}")  # the index, not its version folder


def test_a_nan_node_row_is_refused_even_without_checksums(index, cli):
    """One NaN row would make the prefilters' bounds NaN and drop it from every maximum: wrong seeds."""
    emb = np.load(data_dir(index) / "node_embeddings.npy")
    emb[5, 3] = np.nan
    _rewrite(index, "node_embeddings", emb)
    assert any("NaN" in p for p in check_index(index))
    with pytest.raises(QCGError, match="node_embeddings.npy row 5 holds NaN or infinite values") as refused:
        QCGIndex.load(index, verify=False)
    assert str(refused.value).endswith(f"run: qcg check {index}")
    result = cli("query", index, "--query", "house rules", "--no-verify")
    assert result.returncode == 2 and "row 5 holds NaN" in result.stderr and "Traceback" not in result.stderr


def test_inconsistent_graph_is_refused_even_without_checksums(index):
    indices = np.load(data_dir(index) / "knn_indices.npy")
    indices[3] = 10**6  # a node id that does not exist: the numba kernels would read out of bounds
    _rewrite(index, "knn_indices", indices)
    assert any("outside" in p for p in check_index(index))
    with pytest.raises(QCGError, match="inconsistent: knn_indices holds node ids outside"):
        QCGIndex.load(index, verify=False)
    indices[3] = indices[4]
    indices[0] = 0  # node 0's first edge points back to node 0
    _rewrite(index, "knn_indices", indices)
    assert "the kNN graph has self-loops" in check_index(index)


def test_embeddings_that_are_not_unit_length(index):
    emb = np.load(data_dir(index) / "chunk_embeddings.npy")
    _rewrite(index, "chunk_embeddings", emb * 2)
    problems = check_index(index)
    assert len(problems) == 1 and "chunk_embeddings rows are not unit length (worst |norm - 1| = 1)" in problems[0]


def test_missing_and_foreign_files(index, tmp_path, cli):
    (data_dir(index) / "nodes.parquet").unlink()
    result = cli("query", index, "--query", "house rules")
    assert result.returncode == 2 and "missing nodes.parquet" in result.stderr
    manifest = json.loads((index / "manifest.json").read_text())
    manifest["format_version"] = 99
    (index / "manifest.json").write_text(json.dumps(manifest))
    result = cli("check", index)
    assert result.returncode == 2 and "index format 99" in result.stderr
    result = cli("check", tmp_path / "nowhere")
    assert result.returncode == 2 and "is not a qcg index" in result.stderr


def test_a_manifest_edited_without_its_settings_or_counts_is_refused(index, cli):
    manifest = json.loads((index / "manifest.json").read_text())
    del manifest["settings"], manifest["counts"]["nodes"]
    (index / "manifest.json").write_text(json.dumps(manifest))
    problems = ["manifest.json has no 'settings' object", "manifest.json has no counts.nodes"]
    assert check_index(index) == problems  # was "sound"
    result = cli("query", index, "--query", "house rules")  # was a KeyError traceback
    assert result.returncode == 2 and f"index {index} is corrupt: {'; '.join(problems)}" in result.stderr
    with pytest.raises(QCGError, match="manifest.json has no 'settings' object"):
        QCGIndex.load(index)
