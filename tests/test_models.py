"""Packaged models: names, the parts joined and checked against the published sha256, `qcg models`."""

from __future__ import annotations

import hashlib

import pytest

from qcg_gpu.config import GenerationConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.llm import llm_name
from qcg_gpu.models import (
    DEFAULT_LLM,
    QWEN_CODER_1_5B,
    SMOLLM2,
    _join_checked,
    llm_identity,
    packaged_llm,
    resolve_model,
)

from .conftest import qcg


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
    assert unknown.stderr.strip() == "qcg: error: unknown model 'gpt-5'; choose from smollm2-135m, qwen2.5-coder-1.5b"
