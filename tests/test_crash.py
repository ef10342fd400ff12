"""SIGKILL of a real `qcg index` process at each stage: nothing half-written is ever visible, the
previous index stays sound, and the rerun reuses every finished LLM batch."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from qcg_gpu import build_index
from qcg_gpu.config import IndexConfig
from qcg_gpu.index_format import SUPERSEDED, data_dir, load_table, read_manifest
from qcg_gpu.integrity import check_index

from .conftest import sample_docs

# ``python -m qcg_gpu.cli`` with Ctrl-C's usual handler: a process started in the background of a
# non-interactive shell (nohup ... &, as CI may be) inherits SIGINT ignored, and Python keeps it so.
INTERRUPTIBLE_CLI = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('qcg_gpu.cli', run_name='__main__', alter_sys=True)"
)


def _start(*args, interruptible: bool = False, output=subprocess.PIPE):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = ["-c", INTERRUPTIBLE_CLI] if interruptible else ["-m", "qcg_gpu.cli"]
    return subprocess.Popen(
        [sys.executable, *cli, "index", *map(str, args)],
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _kill_at(process, marker: str, timeout: float = 600) -> str:
    """Read the run's output until ``marker`` appears, then SIGKILL it; returns what was read."""
    seen, deadline = [], time.monotonic() + timeout
    for line in process.stdout:
        seen.append(line)
        if marker in line or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    return "".join(seen)


def _visible(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))


def _sentence_config(chunk_tokens: int | None = None) -> IndexConfig:
    """What ``--nodes sentence --device cpu [--chunk-tokens N]`` sets."""
    config = IndexConfig()
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    if chunk_tokens:
        config.chunking.chunk_tokens = chunk_tokens
    return config


@pytest.mark.parametrize("stage", ["[qcg] embed", "[qcg] knn", "[qcg] write"])
def test_kill_during_a_rebuild_keeps_a_sound_index(tmp_path, stage, embedder):
    docs = sample_docs(tmp_path / "docs", 4)
    index = tmp_path / "index"
    build_index(docs, index, _sentence_config(), embedder=embedder)  # in this process: only the kill needs its own
    before = read_manifest(index)

    options = ("--nodes", "sentence", "--device", "cpu", "--chunk-tokens", "300", "--overwrite")
    output = _kill_at(_start(docs, index, *options), stage)
    assert stage in output
    assert check_index(index) == []  # the old version, or the new one if the kill came after publishing
    assert read_manifest(index)["counts"]["chunks"] in (before["counts"]["chunks"], _chunks_at_300(docs))
    assert _visible(tmp_path) == ["docs", "index"]

    build_index(docs, index, _sentence_config(300), overwrite=True, embedder=embedder)  # the rerun
    assert check_index(index) == [] and read_manifest(index)["counts"]["chunks"] == _chunks_at_300(docs)
    # besides the live version only published, superseded ones (kept a while for their readers): no orphans
    assert all((p / SUPERSEDED).exists() for p in index.iterdir() if p.is_dir() and p != data_dir(index))


def _chunks_at_300(docs) -> int:
    from qcg_gpu.config import ChunkingConfig
    from qcg_gpu.indexing.chunking import chunk_document, load_tokenizer
    from qcg_gpu.indexing.documents import SkipLog, read_documents

    tokenizer, config = load_tokenizer("cl100k_base"), ChunkingConfig(chunk_tokens=300)
    return sum(
        len(list(chunk_document(d.doc_id, d.pieces(), tokenizer, config))) for d in read_documents(docs, SkipLog())
    )


@pytest.mark.llm
def test_kill_during_generation_loses_at_most_the_batch_in_flight(tmp_path, cli, vllm_backend, embedder):
    docs = sample_docs(tmp_path / "docs", 4)
    cache, index = tmp_path / "cache.sqlite", tmp_path / "index"
    # M = 2 and one chunk a batch: short steps, so the kill lands between batches without a long wait
    options = ("--m", "2", "--batch-chunks", "1", "--cache", cache, "--device", "cpu")
    with open(tmp_path / ".killed.log", "w") as log:  # a file, not a pipe nobody reads: --verbose fills one
        process = _start(docs, index, *options, "--verbose", output=log)
        deadline = time.monotonic() + 600
        while _cached(cache) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    done = _cached(cache)
    assert 2 <= done < 4, "the kill should land during generation"
    assert [p for p in _visible(tmp_path) if not p.startswith("cache.sqlite")] == [
        "docs"
    ]  # no index, not even a partial one

    # the rerun, on this process's engine (a fresh engine replies the same: the seeds come from the run's
    # seed and the chunk, and each generation starts from an empty prefix cache; issue 15)
    rerun = build_index(docs, index, _config(cache), llm=vllm_backend, embedder=embedder)
    assert (rerun.generated_chunks, rerun.cached_chunks) == (4 - done, done)  # nothing finished was regenerated
    earlier = read_manifest(index)["replies_from_earlier_runs"]  # the chunks replied in the killed run's batches
    assert sum(stop - start for start, stop in earlier) == done and 0 <= earlier[0][0] and earlier[-1][1] <= 4
    assert check_index(index) == []
    # a third run, entirely from the cache, writes the same index
    again = cli("index", docs, tmp_path / "again", *options, "--quiet")  # no engine to start: in this process
    assert "0 chunks generated, 4 from cache" in again.stdout
    assert read_manifest(tmp_path / "again")["replies_from_earlier_runs"] == [[0, 4]]
    assert load_table(tmp_path / "again", "pairs").equals(load_table(index, "pairs"))
    # and so does an uninterrupted run with a fresh cache
    fresh = _config(tmp_path / "fresh.sqlite")
    summary = build_index(docs, tmp_path / "uninterrupted", fresh, llm=vllm_backend, embedder=embedder)
    assert (summary.generated_chunks, summary.cached_chunks) == (4, 0)
    assert read_manifest(tmp_path / "uninterrupted")["replies_from_earlier_runs"] == []
    assert load_table(tmp_path / "uninterrupted", "pairs").equals(load_table(index, "pairs"))
    assert " INFO " in (tmp_path / ".killed.log").read_text()  # vLLM's own log, with --verbose


def _config(cache) -> IndexConfig:
    """The killed run's options as settings."""
    config = IndexConfig()
    config.generation.m, config.generation.batch_chunks = 2, 1
    config.generation.cache, config.nodes.device = str(cache), "cpu"
    return config


def _cached(cache) -> int:
    if not cache.exists():
        return 0
    try:
        with sqlite3.connect(cache, timeout=1) as db:
            return db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_ctrl_c_ends_in_one_line_and_leaves_nothing_behind(tmp_path):
    docs = sample_docs(tmp_path / "docs", 4)
    process = _start(docs, tmp_path / "index", "--nodes", "sentence", "--device", "cpu", interruptible=True)
    seen = []
    for line in process.stdout:  # interrupted while it embeds, as a user pressing Ctrl-C would
        seen.append(line)
        if "[qcg] embed" in line:
            break
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=120)
    assert process.returncode == 130, "".join(seen) + rest
    assert "qcg: interrupted" in rest and "Traceback" not in rest, rest
    assert _visible(tmp_path) == ["docs"]  # no index, and no half-written one
