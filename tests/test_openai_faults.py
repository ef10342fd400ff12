"""The OpenAI-compatible backend against HTTP faults: a proxy on loopback answers some requests with
429, 500 or a stall past the timeout, and forwards the rest to the real vLLM server."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qcg_gpu.config import GenerationConfig
from qcg_gpu.index_format import read_manifest
from qcg_gpu.llm.backends import OpenAIBackend, SamplingSpec

pytestmark = pytest.mark.llm
TIMEOUT_S = 20  # the client's request timeout: over twice a real request's (at most 78 tokens; 10 tok/s on a loaded CI)


class FaultyProxy:
    """``plan(n, body)`` -> None to forward request n, or a fault: an HTTP status, or "stall"."""

    def __init__(self, upstream: str, plan):
        self.upstream, self.plan, self.seen, self.lock = upstream, plan, [], threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with proxy.lock:
                    n = len(proxy.seen)
                    fault = proxy.plan(n, body)
                    proxy.seen.append(fault)
                if fault == "stall":
                    time.sleep(TIMEOUT_S + 5)  # past the client's timeout; then hang up without a reply
                    return
                if fault is not None:
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "injected fault"}}')
                    return
                request = urllib.request.Request(
                    proxy.upstream + self.path.removeprefix("/v1"),
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=300) as reply:
                    payload = reply.read()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()


def _index(cli, proxy, docs, out, cache, *extra):
    return cli(
        "index",
        docs,
        out,
        "--backend",
        "openai",
        "--base-url",
        proxy.url,
        "--model",
        "smollm2",
        "--m",
        1,  # one short pair a chunk (a reply of at most 78 tokens), so a real request never nears TIMEOUT_S
        "--max-question-chars",
        60,
        "--max-answer-chars",
        30,
        "--concurrency",
        2,
        "--request-timeout",
        TIMEOUT_S,
        "--cache",
        cache,
        "--quiet",
        *extra,
    )


def test_429_500_and_timeouts_are_retried(vllm_server, few_docs, tmp_path, cli):
    faults = {0: 429, 1: 500, 2: "stall", 3: 429}
    proxy = FaultyProxy(vllm_server, lambda n, body: faults.get(n))
    try:
        result = _index(cli, proxy, few_docs, tmp_path / "idx", tmp_path / "cache.sqlite", "--max-retries", 4)
    finally:
        proxy.close()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "4 chunks generated" in result.stdout and "FAILED" not in result.stdout
    assert proxy.seen[:4] == [429, 500, "stall", 429] and proxy.seen.count(None) == 4  # every chunk got through once


def test_a_chunk_that_keeps_failing_is_listed_and_retried_on_the_next_run(vllm_server, few_docs, tmp_path, cli):
    first_doc = sorted(few_docs.glob("*.txt"))[0].read_text().splitlines()[1][:40]  # a line only chunk 0 holds
    broken = FaultyProxy(
        vllm_server, lambda n, body: 500 if first_doc in json.loads(body)["messages"][-1]["content"] else None
    )
    try:
        result = _index(cli, broken, few_docs, tmp_path / "idx", tmp_path / "cache.sqlite", "--max-retries", 1)
    finally:
        broken.close()
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-2000:]
    assert (
        "FAILED chunks (no LLM reply; rerun to retry): [0]" in result.stdout and "InternalServerError" in result.stdout
    )
    assert read_manifest(tmp_path / "idx")["failed_chunks"][0][0] == 0
    assert broken.seen.count(500) == 2  # the request and its one retry

    healthy = FaultyProxy(vllm_server, lambda n, body: None)
    try:
        rerun = _index(cli, healthy, few_docs, tmp_path / "idx", tmp_path / "cache.sqlite", "--overwrite")
    finally:
        healthy.close()
    assert rerun.returncode == 0 and "1 chunk generated, 3 from cache" in rerun.stdout
    assert len(healthy.seen) == 1


def test_replies_stream_back_one_by_one_and_an_early_stop_sends_no_more(vllm_server):
    """Each reply comes back as it arrives (a caller caches it at once); a caller that stops early (a
    killed run) leaves the requests not yet started unsent."""
    proxy = FaultyProxy(vllm_server, lambda n, body: None)
    config = GenerationConfig(backend="openai", base_url=proxy.url, model="smollm2", concurrency=2)
    backend = OpenAIBackend(config)
    asked = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(12)]
    sampling = SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=8, seed=0)
    try:
        streamed = list(backend.chat_batches(asked, sampling, len(asked)))
        assert [len(rows) for rows, _ in streamed] == [1] * 12
        assert sorted(row for rows, _ in streamed for row in rows) == list(range(12))
        assert all(c.output_tokens > 0 and c.error is None for _, completions in streamed for c in completions)
        proxy.seen.clear()
        batches = backend.chat_batches(asked, sampling, len(asked))
        next(batches)
        batches.close()
        time.sleep(3)  # what was in flight lands
        assert 1 <= len(proxy.seen) <= 4  # the first reply, the two requests then in flight, one at most starting
    finally:
        proxy.close()
