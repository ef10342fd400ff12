"""vLLM in a process that also runs the numba retrieval kernels (a fresh process per test)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qcg_gpu.answer import answer_from_chunks
from qcg_gpu.config import AnswerConfig
from qcg_gpu.index_format import load_table

from .conftest import qcg

pytestmark = pytest.mark.llm

SCRIPT = """
import numpy as np
from qcg_gpu.kernels.seeds_cpu import top_n_above
top_n_above(np.ones((2, 5), np.float32), np.float32(0.5), 2)   # numba/llvmlite now loaded
from qcg_gpu.config import GenerationConfig
from qcg_gpu.llm.backends import SamplingSpec, VLLMBackend
backend = VLLMBackend(GenerationConfig())
[reply] = backend.chat([[{"role": "user", "content": "Say hello."}]], SamplingSpec(0.0, 1.0, 8, 0))
print("REPLY", reply.output_tokens, reply.error)
"""


def test_vllm_starts_after_numba_was_imported():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, error = result.stdout.split("REPLY ")[1].split()
    assert int(tokens) > 0 and error == "None"


def test_answer_with_in_process_vllm(small_index, vllm_backend, cli):
    # qcg answer = qcg query's chunks + the LLM's greedy reply to a prompt built from their texts:
    # the same reply as answering those chunks in this process with the same engine settings
    args = ["--queries", small_index / "../docs/20260105_1400.txt", "--gamma", "1.0", "--retrieval-backend", "numpy"]
    result = qcg("answer", small_index, *args, "--max-answer-tokens", 24, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    # --quiet: none of the engine's start-up noise (its weights' progress bar, FutureWarnings, Triton's note,
    # its INFO log, torch's C++ log)
    noise = ("Loading safetensors", "FutureWarning", "Triton", " INFO ", "Warning: NUMA binding")
    assert not [w for w in noise if w in result.stderr], result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    retrieved = [json.loads(line) for line in cli("query", small_index, *args).stdout.splitlines()]
    assert len(records) > 3 and [r["chunks"] for r in records] == [r["chunks"] for r in retrieved]
    texts = load_table(small_index, "chunks").column("text").to_pylist()
    expected = answer_from_chunks(
        vllm_backend,
        [r["query"] for r in records],
        [[c["chunk_id"] for c in r["chunks"]] for r in records],
        texts,
        AnswerConfig(max_answer_tokens=24),
    )
    assert [r["answer"] for r in records] == [c.text.strip() for c in expected]
    assert all(r["answer"] and "error" not in r for r in records)
    assert all(0 < c.output_tokens <= 24 for c in expected)
