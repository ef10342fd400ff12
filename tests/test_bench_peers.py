"""The peer benchmark's measuring parts on real components: the vLLM server's own counters against
the usage its replies report, the embedding endpoint LightRAG calls against the embedder itself,
and the choice of documents."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_peers():
    spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "benchmarks" / "bench_peers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_peers"]


@pytest.mark.llm
def test_server_counters_match_the_usage_replies_report(bench_peers, vllm_server):
    openai = pytest.importorskip("openai")
    server = vllm_server.removesuffix("/v1")
    client = openai.OpenAI(base_url=vllm_server, api_key="not-needed")
    before = bench_peers.server_counters(server)
    usages = []
    for text in ("Name a colour.", "Write one word about bread, please."):
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0
        )
        usages.append(reply.usage)
    delta = bench_peers.counter_delta(before, bench_peers.server_counters(server))
    assert delta["requests"] == 2
    assert delta["prompt_tokens"] == sum(u.prompt_tokens for u in usages)
    assert delta["output_tokens"] == sum(u.completion_tokens for u in usages)
    assert sum(delta["finish_reasons"].values()) == 2 and set(delta["finish_reasons"]) <= {"stop", "length"}


def test_read_counters_sums_label_sets_and_skips_other_metrics(bench_peers):
    page = "\n".join(
        [
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 20.0',
            'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9',
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0',
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0',
            'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 0.0',
            "vllm:generation_tokens_total 7.0",
        ]
    )
    counters = bench_peers.read_counters(page)
    assert counters["prompt_tokens"] == 120 and counters["output_tokens"] == 7 and counters["requests"] == 4
    assert counters["cached_prompt_tokens"] == 0
    assert counters["finish_reasons"] == {"stop": 3, "length": 1, "abort": 0}


def test_embedding_endpoint_answers_like_the_embedder(bench_peers):
    openai = pytest.importorskip("openai")
    port = free_port()
    texts = ["Li Hua ordered a cake.", "The bakery delivers on Fridays. " * 60]  # the second is over 256 tokens
    with bench_peers.embedding_endpoint(port) as endpoint:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed")
        as_float = client.embeddings.create(model="any", input=texts, encoding_format="float")
        as_default = client.embeddings.create(model="any", input=texts)  # the client asks for base64
        expected = endpoint.embedder.encode(texts)
        assert endpoint.texts == 4
    for response in (as_float, as_default):
        got = np.array([item.embedding for item in response.data], dtype=np.float32)
        np.testing.assert_allclose(got, expected, atol=1e-6)
    assert [item.index for item in as_float.data] == [0, 1]


def test_select_documents_spreads_over_the_corpus(bench_peers, tmp_path):
    corpus = tmp_path / "corpus"
    for week in range(5):
        (corpus / f"week{week}").mkdir(parents=True)
        for day in range(4):
            (corpus / f"week{week}" / f"2026010{day}.txt").write_text(f"week {week} day {day}")
    chosen = bench_peers.select_documents(corpus, 5, tmp_path / "docs")
    assert [p.parent.name for p in chosen] == [f"week{w}" for w in range(5)]
    copies = sorted((tmp_path / "docs").iterdir())
    assert [c.name for c in copies] == [f"week{w}_20260100.txt" for w in range(5)]
    assert copies[3].read_text() == "week 3 day 0"
    with pytest.raises(SystemExit, match="--docs must be in 1..20"):
        bench_peers.select_documents(corpus, 21, tmp_path / "more")
