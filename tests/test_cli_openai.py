"""The CLI, and the OpenAI-compatible backend against a real vLLM server process on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qcg_gpu.index_format import load_table, read_manifest

from .conftest import free_port, qcg


@pytest.mark.llm
def test_index_through_openai_server(vllm_server, few_docs, tmp_path, cli):
    out = tmp_path / "idx"
    result = cli(
        "index",
        few_docs,
        out,
        "--backend",
        "openai",
        "--base-url",
        vllm_server,
        "--model",
        "smollm2",
        "--m",
        1,
        "--concurrency",
        4,
        "--cache",
        tmp_path / "cache.sqlite",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "index written to" in result.stdout and "4 chunks generated" in result.stdout
    manifest = read_manifest(out)
    assert manifest["models"]["llm"] == "smollm2" and manifest["settings"]["generation"]["backend"] == "openai"
    assert manifest["llm_tokens"]["output"] > 0  # the server's usage counts were recorded
    pairs = load_table(out, "pairs").to_pylist()
    assert pairs and all(p["question"] and p["answer"] for p in pairs)

    rerun = cli(
        "index",
        few_docs,
        out,
        "--overwrite",
        "--backend",
        "openai",
        "--base-url",
        vllm_server,
        "--model",
        "smollm2",
        "--m",
        1,
        "--cache",
        tmp_path / "cache.sqlite",
        "--quiet",
    )
    assert rerun.returncode == 0 and "0 chunks generated, 4 from cache" in rerun.stdout


def test_unreachable_server_fails_chunks_not_the_run(few_docs, tmp_path, cli):
    out, url = tmp_path / "idx", f"http://127.0.0.1:{free_port()}/v1"
    result = cli(
        "index",
        few_docs,
        out,
        "--backend",
        "openai",
        "--base-url",
        url,
        "--model",
        "x",
        "--m",
        3,
        "--max-retries",
        1,
        "--request-timeout",
        5,
        "--cache",
        tmp_path / "c.sqlite",
        "--quiet",
    )
    assert result.returncode == 3, result.stderr[-2000:]
    assert "FAILED chunks (no LLM reply; rerun to retry): [0, 1, 2, 3]" in result.stdout
    # the client's own error ("Connection error.") did not say which server
    assert f"first error: no server answered at {url} (APIConnectionError: Connection error.)" in result.stdout
    assert read_manifest(out)["counts"]["chunks_failed"] == 4


def test_a_server_that_is_down_is_not_sent_the_rest_of_the_run():
    """Each request to a server that is down waits out its retries (about 15 s at the default 5): a large
    corpus spent hours failing chunk after chunk. Past two rounds of --concurrency such failures in a row,
    the rest fail unsent, for a rerun once the server is back."""
    from qcg_gpu.config import GenerationConfig
    from qcg_gpu.llm.backends import OpenAIBackend, SamplingSpec

    url = f"http://127.0.0.1:{free_port()}/v1"
    config = GenerationConfig(backend="openai", base_url=url, model="m", concurrency=2, max_retries=0)
    asked = [[{"role": "user", "content": f"question {i}"}] for i in range(30)]
    replies = OpenAIBackend(config).chat(asked, SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=4, seed=0))
    errors = [reply.error for reply in replies]
    tried = [e for e in errors if e == f"no server answered at {url} (APIConnectionError: Connection error.)"]
    assert 4 <= len(tried) <= 5, errors  # two rounds of two, and one that had started alongside
    assert errors.count(f"not sent: 4 requests in a row found no server at {url}") == 30 - len(tried)


@pytest.mark.parametrize(
    "args,message",
    [
        (["{tmp}/missing", "{tmp}/out"], "input not found"),
        (["{tmp}/empty", "{tmp}/out"], "no .txt or .md files"),
        (["{docs}", "{tmp}/out", "--model", "/no/such/model"], "model path does not exist: /no/such/model"),
        (
            ["{docs}", "{tmp}/out", "--chunk-overlap", "2000"],
            "--chunk-overlap (chunk_overlap) must be in [0, --chunk-tokens), got 2000",
        ),
        (["{docs}", "{tmp}/out", "--alpha", "1.5"], "--alpha (alpha) must be in (0, 1], got 1.5"),
        (["{docs}", "{tmp}/out", "--knn-k", "0"], "--knn-k (knn_k) must be >= 1, got 0"),  # named knn_k alone
        (["{docs}", "{tmp}/out", "--backend", "openai"], "--backend openai needs --base-url"),
        (
            ["{docs}", "{tmp}/out", "--backend", "openai", "--model", "m", "--base-url", "127.0.0.1:8000/v1"],
            "--base-url (base_url) must be an http(s) URL such as http://127.0.0.1:8000/v1, got '127.0.0.1:8000/v1'",
        ),
        (["{docs}", "{tmp}/out", "--replies-in", "{tmp}/none.parquet"], "stored replies file not found"),
        (["{docs}", "{tmp}"], "already exists; pass --overwrite"),
    ],
)
def test_bad_input_gets_one_clear_line(args, message, few_docs, tmp_path):
    (tmp_path / "empty").mkdir()
    result = qcg("index", *[a.format(tmp=tmp_path, docs=few_docs) for a in args], "--quiet")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.llm
def test_a_model_the_server_does_not_serve_stops_the_run_in_one_line(vllm_server, few_docs, small_index, tmp_path):
    """Every request would fail (404): the build and the answers stop at the first, in one line, writing nothing
    (they failed every chunk, and wrote an index of none)."""
    served = ("--backend", "openai", "--base-url", vllm_server, "--model", "smollm-2", "--quiet")
    for command in (
        ("index", few_docs, tmp_path / "idx"),
        ("answer", small_index, "--query", "Who is Adam?", "--gamma", "1.0"),
    ):
        result = qcg(*command, *served)
        assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
        message = f"qcg: error: the server at {vllm_server} answered 404 for model 'smollm-2' (it serves ['smollm2'])"
        assert result.stderr.startswith(message) and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "idx").exists()


def test_a_server_that_refuses_the_api_key_is_named_in_one_line(few_docs, tmp_path, cli, monkeypatch):
    """A server that answers 401 (a stand-in for one started with --api-key): the run stops at the first reply."""

    class Refuses(BaseHTTPRequestHandler):
        def do_POST(self):
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("QCG_TEST_KEY", "wrong")
    try:
        build = ("index", few_docs, tmp_path / "idx", "--backend", "openai", "--base-url", url, "--model", "m")
        missing = cli(*build, "--quiet")
        assert missing.returncode == 2 and f"{url} needs an API key: set $OPENAI_API_KEY" in missing.stderr
        wrong = cli(*build, "--api-key-env", "QCG_TEST_KEY", "--quiet")
        assert wrong.returncode == 2 and f"{url} refused the API key in $QCG_TEST_KEY" in wrong.stderr
    finally:
        server.shutdown()
    assert not (tmp_path / "idx").exists()


@pytest.mark.llm
def test_answer_through_openai_server(vllm_server, small_index, cli):
    result = cli(
        "answer",
        small_index,
        "--query",
        "What house rule does Adam mention?",
        "--gamma",
        "1.0",
        "--backend",
        "openai",
        "--base-url",
        vllm_server,
        "--model",
        "smollm2",
        "--max-answer-tokens",
        40,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [record] = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["chunks"] and isinstance(record["answer"], str) and record["answer"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--base-url", "notaurl"], "--base-url (base_url) must be an http(s) URL"),  # every answer failed, rc 3
        (["--base-url", "http://127.0.0.1:9/v1", "--concurrency", "0"], "--concurrency (concurrency) must be >= 1"),
    ],
)
def test_the_answering_server_s_settings_are_checked_before_any_query(small_index, args, message, cli):
    """They were not checked on qcg answer's path (only the in-process engine's settings were)."""
    result = cli("answer", small_index, "--query", "Who is Adam?", "--backend", "openai", "--model", "m", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qcg: error: {message}")


def test_a_plan_for_a_served_model_counts_prompts_offline(few_docs, tmp_path):
    """It asked tiktoken for cl100k_base, which tiktoken downloads: a traceback on a machine offline."""
    result = qcg(
        "index", "plan", few_docs, "--backend", "openai", "--model", "m", "--base-url", "http://127.0.0.1:9/v1"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(estimate: cl100k_base, the model's tokenizer is not local)" in result.stdout
    prompt_tokens = int(result.stdout.split("prompt tokens: ")[1].split()[0])
    assert prompt_tokens > 4 * 100  # four chat logs, each a system prompt and a chunk


@pytest.mark.llm
def test_answers_that_fail_are_written_with_their_error_and_exit_3(small_index, tmp_path, cli):
    """A server that is down: each record keeps its chunks and the error, and the exit code says it (was 0)."""
    (tmp_path / "q.txt").write_text("Who is Adam?\nWhere does Li Hua live?\n")
    down = ("--backend", "openai", "--base-url", "http://127.0.0.1:9/v1", "--model", "smollm2", "--max-retries", 0)
    result = cli("answer", small_index, "--queries", tmp_path / "q.txt", "--gamma", "1.0", *down)
    assert result.returncode == 3
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 2 and all(r["chunks"] and r["answer"] is None and r["error"] for r in records)
    assert "2 of 2 answers failed (no server answered at http://127.0.0.1:9/v1 (APIConnectionError" in result.stderr
