"""Many processes query one index while new versions of it are published next to them: every reader
keeps seeing one complete, self-consistent version (never a missing or mixed one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

from qcg_gpu import build_index
from qcg_gpu.config import IndexConfig

from .conftest import sample_docs

READER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import numpy as np
    from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever

    root, stop, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    queries = np.random.default_rng(0).standard_normal((8, 384)).astype(np.float32)
    seen, loads = set(), 0
    while not stop.exists():
        index = QCGIndex.load(root)
        result = Retriever(index, RetrievalConfig(gamma=0.0, backend="torch", device="cpu")).search(queries)
        time.sleep(0.02)  # a rebuild may publish a new version now
        chunks = index.chunks  # read lazily, after the search
        assert chunks.num_rows == index.n_chunks == index.manifest["counts"]["chunks"], "mixed versions"
        assert result.chunk_ids.max() < chunks.num_rows
        seen.add(chunks.num_rows)
        loads += 1
        ready.touch()
    print(loads, sorted(seen))
""")


def _config(chunk_tokens: int) -> IndexConfig:
    config = IndexConfig()
    config.chunking.chunk_tokens, config.chunking.chunk_overlap = chunk_tokens, 8
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    return config


def test_readers_keep_a_consistent_version_while_rebuilds_publish(tmp_path, embedder):
    docs = sample_docs(tmp_path / "docs", 4)
    index, stop = tmp_path / "index", tmp_path / "stop"
    build_index(docs, index, _config(64), embedder=embedder)
    ready = [tmp_path / f"ready{i}" for i in range(3)]
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    readers = [  # one thread each: three busy readers must not starve the rebuilds of a 2-core machine
        subprocess.Popen(
            [sys.executable, "-c", READER, str(index), str(stop), str(flag)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=one_thread,
        )
        for flag in ready
    ]
    try:
        deadline = time.monotonic() + 300
        while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:  # every reader is querying
            assert all(reader.poll() is None for reader in readers), "a reader died before its first query"
            time.sleep(0.1)
        for round_ in range(4):  # alternate chunk sizes, so versions differ in their chunk counts
            build_index(docs, index, _config(200 if round_ % 2 == 0 else 64), overwrite=True, embedder=embedder)
    finally:
        stop.touch()
        outputs = [reader.communicate(timeout=120) for reader in readers]
    for reader, (out, err) in zip(readers, outputs):
        assert reader.returncode == 0, err[-3000:]
        loads, _ = out.split(" ", 1)
        assert int(loads) >= 1
    assert any(len(eval(out.split(" ", 1)[1])) == 2 for out, _ in outputs)  # some reader saw both versions


def test_a_process_that_read_an_index_exits_cleanly(tmp_path, embedder):
    """A table read through a Python file object with pyarrow's pre-buffering left I/O threads that
    aborted about one exit in two (status 134: "terminate called without an active exception")."""
    index = tmp_path / "index"
    build_index(sample_docs(tmp_path / "docs", 2), index, _config(64), embedder=embedder)
    read = f"from qcg_gpu.retrieval import QCGIndex; print(QCGIndex.load(r'{index}').chunks.num_rows)"
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # as a reader of a busy machine runs: it aborted most so
    runs = [
        subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, env=one_thread) for _ in range(8)
    ]
    assert [run.returncode for run in runs] == [0] * 8, runs[0].stderr[-2000:]
