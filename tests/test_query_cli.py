"""qcg query on a real index: texts embedded by the index's embedder, traces, baselines, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from qcg_gpu.answer import build_context
from qcg_gpu.cli.query_io import load_query_embeddings, read_queries
from qcg_gpu.errors import QCGError
from qcg_gpu.index_format import data_dir, load_table
from qcg_gpu.indexing.chunking import load_tokenizer
from qcg_gpu.retrieval import RetrievalConfig, Retriever

from .conftest import qcg

pytestmark = pytest.mark.llm


def _records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_query_text_with_trace(small_index, embedder):
    question = "What time does Li Hua check in with Adam about moving in?"
    result = qcg("query", small_index, "--query", question, "--gamma", "1.0", "--trace")
    assert result.returncode == 0, result.stderr[-2000:]
    [record] = _records(result.stdout)
    assert record["query_id"] == "0" and record["query"] == question
    chunks = record["chunks"]
    assert 0 < len(chunks) <= 5 and [c["score"] for c in chunks] == sorted((c["score"] for c in chunks), reverse=True)
    doc_ids = load_table(small_index, "chunks").column("doc_id").to_pylist()
    assert all(doc_ids[c["chunk_id"]] == c["doc_id"] for c in chunks)
    # the same through the Python API with the same embedder
    api = Retriever(small_index, RetrievalConfig(gamma=1.0)).search(embedder.encode([question]))
    assert [c["chunk_id"] for c in chunks] == [c for c in api.chunk_ids[0].tolist() if c >= 0]
    trace = record["trace"]
    assert 0 < len(trace["seeds"]) <= 10 and all(s["sim"] >= 0.0 for s in trace["seeds"])
    assert [c["chunk_id"] for c in trace["chunks"][: len(chunks)]] == [c["chunk_id"] for c in chunks]
    assert sum(c["n_nodes"] for c in trace["chunks"]) == len(trace["seeds"]) + len(trace["expanded"])


def test_query_file_with_blank_lines_and_out_file(small_index, tmp_path, cli):
    path = tmp_path / "q.txt"
    path.write_text("Who is Adam?\n\n   \nWhere does Li Hua live?\n")
    out = tmp_path / "results.jsonl"
    result = cli("query", small_index, "--queries", path, "--preset", "multihop-rag", "--out", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["query_id"] for r in _records(out.read_text())] == ["1", "4"]


def test_queries_that_find_no_seed_are_named_in_one_line(small_index, tmp_path, cli):
    path = tmp_path / "q.txt"
    path.write_text("Who is Adam?\nWhere does Li Hua live?\n")
    unseeded = cli("query", small_index, "--queries", path, "--gamma", "2.0")
    assert unseeded.returncode == 0 and [r["chunks"] for r in _records(unseeded.stdout)] == [[], []]
    assert "2 of 2 queries found no node with sim + 1 >= gamma = 2 (cosine >= 1)" in unseeded.stderr
    seeded = cli("query", small_index, "--queries", path, "--gamma", "1.0")
    assert all(r["chunks"] for r in _records(seeded.stdout)) and "found no node" not in seeded.stderr


def test_trec_runs_of_documents_and_chunks(small_index, tmp_path, cli):
    path = tmp_path / "q.txt"
    path.write_text("Who is Adam?\nWhere does Li Hua live?\n")
    args = ["--queries", path, "--gamma", "1.0", "--top-k", "5"]
    records = _records(cli("query", small_index, *args).stdout)
    documents = [line.split() for line in cli("query", small_index, *args, "--format", "trec").stdout.splitlines()]
    chunks = [line.split() for line in cli("query", small_index, *args, "--format", "trec-chunks").stdout.splitlines()]
    positions = load_table(small_index, "chunks").column("chunk_index").to_pylist()
    expected_chunks, expected_documents = [], []
    for record in records:
        ranked = record["chunks"]
        expected_chunks += [
            [record["query_id"], "Q0", f"{c['doc_id']}#{positions[c['chunk_id']]}", str(rank), c["score"]]
            for rank, c in enumerate(ranked, 1)
        ]
        best = list(dict.fromkeys(c["doc_id"] for c in ranked))  # each document at its best chunk
        scores = {c["doc_id"]: c["score"] for c in reversed(ranked)}
        expected_documents += [[record["query_id"], "Q0", d, str(rank), scores[d]] for rank, d in enumerate(best, 1)]
    for lines, expected in ((chunks, expected_chunks), (documents, expected_documents)):
        assert [line[:4] for line in lines] == [e[:4] for e in expected]
        assert np.allclose([float(line[4]) for line in lines], [e[4] for e in expected], atol=1e-6, rtol=0)
    assert all(line[5] == "qcg" for line in documents + chunks)
    refused = cli("query", small_index, *args, "--format", "trec", "--trace")
    assert refused.returncode == 2 and "--trace needs --format jsonl" in refused.stderr


def test_bring_your_own_embeddings(small_index, tmp_path, embedder, cli):
    vectors = embedder.encode(["Who is Adam?", "lunch with Wolfgang"]) * 3.0  # not normalised: qcg normalises
    np.save(tmp_path / "q.npy", vectors)
    result = cli(
        "query", small_index, "--embeddings", tmp_path / "q.npy", "--gamma", "1.0", "--retrieval-backend", "torch"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = _records(result.stdout)
    api = Retriever(small_index, RetrievalConfig(gamma=1.0, backend="numpy")).search(vectors / 3.0)
    assert [[c["chunk_id"] for c in r["chunks"]] for r in records] == [
        [c for c in row if c >= 0] for row in api.chunk_ids.tolist()
    ]
    np.save(tmp_path / "bad.npy", np.ones((2, 7), np.float32))
    bad = cli("query", small_index, "--embeddings", tmp_path / "bad.npy")
    assert bad.returncode == 2 and "shape (B, 384)" in bad.stderr


def _cli_rankings(cli, index, method: str, questions: Path) -> list[list[int]]:
    result = cli("query", index, "--queries", questions, "--method", method, "--top-k", "5")
    assert result.returncode == 0, result.stderr[-2000:]
    return [[c["chunk_id"] for c in record["chunks"]] for record in _records(result.stdout)]


def test_baselines_rank_chunks_by_their_expanded_text(small_index, embedder, cli, tmp_path):
    # METHOD.md, Baselines: naive ranks the chunk texts, D2Q each chunk followed by all its generated
    # questions, D2Q-- by its kept ones; each ranking computed here from the index's own tables
    chunks = load_table(small_index, "chunks").column("text").to_pylist()
    pairs = load_table(small_index, "pairs").to_pylist()
    expanded = {
        "naive": chunks,
        "d2q": [t + "\n" + "\n".join(p["question"] for p in pairs if p["chunk_id"] == c) for c, t in enumerate(chunks)],
        "d2q-minus": [
            t + "\n" + "\n".join(p["question"] for p in pairs if p["chunk_id"] == c and p["kept"])
            for c, t in enumerate(chunks)
        ],
    }
    rankings: dict[str, list[list[int]]] = {}
    questions = ["Who is Adam?", "lunch with Wolfgang", "When does Li Hua move in?"]
    (tmp_path / "q.txt").write_text("\n".join(questions) + "\n")
    for method, texts in expanded.items():
        sims = embedder.encode(questions) @ embedder.encode(texts).T
        expected = [np.argsort(-row, kind="stable")[:5].tolist() for row in sims]
        rankings[method] = _cli_rankings(cli, small_index, method, tmp_path / "q.txt")
        assert rankings[method] == expected, method
    assert rankings["d2q"] != rankings["naive"] and rankings["d2q-minus"] != rankings["naive"]
    # QCG's own settings change nothing here, and say so (they were ignored without a word)
    again = cli("query", small_index, "--queries", tmp_path / "q.txt", "--method", "naive", "--hops", "2", "--n", "3")
    assert [[c["chunk_id"] for c in record["chunks"]] for record in _records(again.stdout)] == rankings["naive"]
    assert "--n, --hops ignored: QCG's settings; --method naive ranks chunks by their own similarity" in again.stderr
    assert "ignored" not in cli("query", small_index, "--queries", tmp_path / "q.txt", "--method", "naive").stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--query", "  "], "the query is empty"),
        (["--query", "x", "--gamma", "3"], "--gamma (gamma) must be in [0, 2], got 3.0"),
        (["--query", "x", "--n", "0"], "--n (n) must be >= 1, got 0"),
        (["--query", "x", "--method", "naive", "--trace"], "--trace follows QCG's seeds and hops; --method naive"),
        (["--queries", "/no/such/file.txt"], "queries file not found"),
        (["--query", "x", "--retrieval-device", "bogus"], "--retrieval-device 'bogus': name cpu, cuda or cuda:N"),
        (["--query", "x", "--retrieval-device", "cuda:7"], "--retrieval-device cuda:7: this machine has"),
        (["--query", "x", "--embed-device", "gpu0"], "the embedding device 'gpu0': name cpu, cuda or cuda:N"),
    ],
)
def test_bad_query_input(small_index, args, message, cli):
    result = cli("query", small_index, *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_answer_settings_are_checked_before_retrieval(small_index, cli):
    # gamma 2 seeds nothing, and a retrieval would say so before the refusal (it did)
    result = cli("answer", small_index, "--query", "x", "--gamma", "2.0", "--max-answer-tokens", "0", "--quiet")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "qcg: error: --max-answer-tokens (max_answer_tokens) must be >= 1, got 0"
    ]


@pytest.mark.parametrize(
    "args,message", [(["--query", "  "], "the query is empty"), (["--queries", "/no/q.txt"], "queries file not found")]
)
def test_answer_reads_its_queries_before_the_llm_loads(small_index, args, message, cli, monkeypatch):
    """An empty --query was refused only once the LLM had loaded (22 s here)."""

    def loaded(*_):
        raise AssertionError("the LLM loaded before the queries were read")

    monkeypatch.setattr("qcg_gpu.cli.query.answering_llm", loaded)
    result = cli("answer", small_index, *args, "--quiet")
    assert result.returncode == 2 and result.stderr.startswith(f"qcg: error: {message}"), result.stderr


@pytest.mark.parametrize("out", ["missing/out.jsonl", "folder", "file/out.jsonl"])
def test_an_unwritable_out_is_refused_before_any_work(small_index, tmp_path, out, cli):
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    # the answering model does not exist either: --out is checked first, before any model or retrieval
    result = cli("answer", small_index, "--query", "x", "--out", tmp_path / out, "--model", tmp_path / "no-model")
    assert result.returncode == 2 and "--out" in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_results_that_cannot_be_written_go_to_stdout(small_index, cli):
    result = cli("query", small_index, "--query", "house rules", "--gamma", "1.0", "--out", "/dev/full")
    assert result.returncode == 2 and "cannot write --out /dev/full" in result.stderr
    assert _records(result.stdout)[0]["query"] == "house rules"  # the work is not lost


def test_a_queries_file_that_is_not_utf8_is_refused_in_one_line(small_index, tmp_path, cli):
    (tmp_path / "q.txt").write_bytes("first question\nwhere is the caf\xe9?\n".encode("latin-1"))
    result = cli("query", small_index, "--queries", tmp_path / "q.txt")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'q.txt'}:2: not UTF-8 text (byte 0xe9)" in result.stderr


def test_queries_with_a_byte_order_mark_repeated_ids_or_lone_surrogates(tmp_path):
    for name, text in [("q.txt", "Who is Adam?\n"), ("q.jsonl", '{"query": "Who is Adam?"}\n')]:
        (tmp_path / name).write_text(text, encoding="utf-8-sig")  # as Windows editors save UTF-8
        assert read_queries(path=tmp_path / name) == (["1"], ["Who is Adam?"])
    (tmp_path / "q.jsonl").write_text('{"query_id": "a", "query": "x"}\n{"query_id": "a", "query": "y"}\n')
    with pytest.raises(QCGError, match="q.jsonl: query id 'a' is given 2 times"):
        read_queries(path=tmp_path / "q.jsonl")
    # half a surrogate pair, escaped in JSON or from bytes that are not UTF-8 in argv: the embedder crashed
    (tmp_path / "q.jsonl").write_text('{"query": "ok"}\n{"query": "caf\\udce9"}\n')
    with pytest.raises(QCGError, match="q.jsonl: query 2 holds a lone surrogate"):
        read_queries(path=tmp_path / "q.jsonl")
    with pytest.raises(QCGError, match="--query: query 1 holds a lone surrogate"):
        read_queries(os.fsdecode(b"caf\xe9"))


def test_missing_index_file_is_refused(small_index, tmp_path, cli):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(small_index, broken)
    (data_dir(broken) / "knn_indices.npy").unlink()
    result = cli("query", broken, "--query", "x")
    assert result.returncode == 2 and "missing knn_indices.npy" in result.stderr


def test_context_is_capped_in_tokens():
    tokenizer = load_tokenizer("cl100k_base")
    chunks = ["word " * 400, "other " * 400, "third " * 400]
    context = build_context(chunks, 700)
    assert len(tokenizer.token_starts(context)) <= 700 + 12  # plus the [rank] labels
    assert "[1]" in context and "[2]" in context and "[3]" not in context


def test_a_json_queries_file_is_read_as_json(small_index, tmp_path, cli):
    """LiHuaWorld's own queries file ({id: {question, ...}}) and a JSON list: one query per entry, not per line."""
    dataset = {
        "62": {"question": "What time does Li Hua check in with Adam?", "answer": "5:30 PM"},
        "7": "Who is Adam?",
    }
    (tmp_path / "q.json").write_text(json.dumps(dataset, indent=2))
    result = cli("query", small_index, "--queries", tmp_path / "q.json", "--gamma", "1.0", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [(r["query_id"], r["query"]) for r in _records(result.stdout)] == [
        ("62", "What time does Li Hua check in with Adam?"),
        ("7", "Who is Adam?"),
    ]
    (tmp_path / "list.json").write_text(json.dumps([{"query": "Who is Adam?", "query_id": "a"}, "Where is the gym?"]))
    result = cli("query", small_index, "--queries", tmp_path / "list.json", "--quiet")
    assert [r["query_id"] for r in _records(result.stdout)] == ["a", "1"]
    (tmp_path / "bad.json").write_text('{"1": {"answer": "no question"}}')
    result = cli("query", small_index, "--queries", tmp_path / "bad.json")
    assert result.returncode == 2 and "query 1: needs a non-empty 'query'" in result.stderr


@pytest.mark.parametrize(
    "array, refusal",
    [
        (np.array(["a", "b"]), "must be real numbers, .* holds <U1"),
        (np.ones((2, 384), np.complex64), "must be real numbers, .* holds complex64"),
        (np.ones((2, 384), bool), "must be real numbers, .* holds bool"),
    ],
)
def test_query_embeddings_that_are_not_real_numbers_are_refused(tmp_path, array, refusal):
    """A string array raised numpy's ValueError; complex and bool arrays were cast and searched."""
    np.save(tmp_path / "q.npy", array)
    with pytest.raises(QCGError, match=refusal):
        load_query_embeddings(tmp_path / "q.npy")


def test_an_npz_archive_of_query_embeddings_is_refused_in_one_line(small_index, tmp_path, cli):
    """np.load reads it as an archive, which had no .size: a traceback."""
    np.savez(tmp_path / "q.npz", queries=np.ones((2, 384), np.float32))
    result = cli("query", small_index, "--embeddings", tmp_path / "q.npz")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "q.npz is an .npz archive, not one array; save the (B, d) embeddings with np.save" in result.stderr


def test_an_empty_embeddings_array_is_refused_like_an_empty_queries_file(small_index, tmp_path, cli):
    np.save(tmp_path / "none.npy", np.zeros((0, 384), np.float32))
    result = cli("query", small_index, "--embeddings", tmp_path / "none.npy")
    assert result.returncode == 2 and "no queries in" in result.stderr and "shape (0, 384)" in result.stderr
