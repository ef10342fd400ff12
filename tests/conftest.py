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


@pytest.fixture(scope="session")
def small_index(tmp_path_factory, vllm_backend, embedder) -> Path:
    """A real index of six LiHuaWorld chat logs (M = 4), built once per session."""
    from qcg_gpu import build_index
    from qcg_gpu.config import IndexConfig

    root = tmp_path_factory.mktemp("small_index")
    docs = root / "docs"
    docs.mkdir()
    for path in sorted((SAMPLE_DOCS / "week1").glob("*.txt"))[:6]:
        shutil.copy(path, docs / path.name)
    config = IndexConfig()
    config.generation.m = 4
    config.generation.cache = str(root / "cache.sqlite")
    config.nodes.device = "cpu"
    build_index(docs, root / "index", config, llm=vllm_backend, embedder=embedder, progress=False)
    return root / "index"
