"""Shared fixtures: the bundled LiHuaWorld sample, and real models loaded once per session."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from qcg_gpu.capabilities import with_cuda

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DOCS = REPO / "examples" / "lihuaworld_sample" / "docs"
DEVICES = ["cpu"] + (["cuda"] if with_cuda() else [])


@pytest.fixture
def few_docs(tmp_path) -> Path:
    """A directory of four short LiHuaWorld chat logs."""
    root = tmp_path / "docs"
    root.mkdir()
    for path in sorted((SAMPLE_DOCS / "week1").glob("*.txt"))[:4]:
        shutil.copy(path, root / path.name)
    return root


@pytest.fixture(scope="session")
def vllm_backend():
    from qcg_gpu.config import GenerationConfig
    from qcg_gpu.llm import VLLMBackend

    return VLLMBackend(GenerationConfig())


@pytest.fixture(scope="session")
def embedder():
    from qcg_gpu.embedding import Embedder

    return Embedder(device="cpu")
