"""qcg eval end to end on a real index (vLLM-made pairs, MiniLM, faiss): methods, ablations, sweeps,
answers and the LLM judge from the real SmolLM2, the report files, and index variants."""

from __future__ import annotations

import csv
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from qcg_gpu.config import AnswerConfig, EvalConfig, GenerationConfig
from qcg_gpu.eval.datasets import load_dataset
from qcg_gpu.eval.harness import Answering, Harness, summarize
from qcg_gpu.eval.metrics import evidence_recall
from qcg_gpu.eval.report import write_report
from qcg_gpu.eval.variants import _rebuild_nodes, derive_index
from qcg_gpu.index_format import load_array, load_table
from qcg_gpu.llm.backends import Completion, LLMBackend
from qcg_gpu.llm.cache import CachedLLM, ReplyStore
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig, Retriever

pytestmark = pytest.mark.llm

QUESTIONS = [  # from the LiHuaWorld dev split, about the small index's six chat logs, plus one it cannot answer
    {
        "query_id": "62",
        "question": "What time does Li Hua check in with Adam about moving in?",
        "answer": "5:30 PM",
        "evidence_doc_ids": ["20260105_1400"],
        "type": "Single",
    },
    {
        "query_id": "68",
        "question": "What house rule does Adam mention?",
        "answer": "keep noise to a minimum during late hours",
        "evidence_doc_ids": ["20260106_0900"],
        "type": "Single",
    },
    {
        "query_id": "n1",
        "question": "What is the name of Li Hua's cat's veterinarian?",
        "answer": "Insufficient information",
        "evidence_doc_ids": [],
        "type": "Null",
    },
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def test_variant_with_own_settings_equals_the_index(small_index, embedder):
    index = QCGIndex.load(small_index)
    same = derive_index(index)
    assert np.array_equal(same.knn_indptr, index.knn_indptr) and np.array_equal(same.knn_indices, index.knn_indices)
    node_emb, node_chunk = _rebuild_nodes(index, index.manifest["settings"]["nodes"]["alpha"], "qa", None, None)
    assert np.array_equal(node_emb, index.node_embeddings) and np.array_equal(node_chunk, index.node_chunk)

    pairs = load_table(small_index, "pairs").to_pydict()
    everything = derive_index(index, alpha=1.0, knn_k=3)
    assert len(everything.node_chunk) == len(pairs["chunk_id"])  # alpha = 1 keeps every valid pair
    assert np.all(np.diff(everything.knn_indptr) == 3)
    assert np.array_equal(everything.node_embeddings, load_array(small_index, "pair_embeddings"))

    first_two = derive_index(index, alpha=1.0, max_pairs=2)  # M = 2: each chunk's first two valid pairs
    first = np.flatnonzero(np.array(pairs["gen_index"]) < 2)
    assert np.array_equal(first_two.node_embeddings, load_array(small_index, "pair_embeddings")[first])
    assert first_two.manifest["first_pairs"] == 2 and np.bincount(first_two.node_chunk).max() == 2
    half = derive_index(index, alpha=0.5, max_pairs=2)  # ceil(0.5 * 2): the better-scored of the two
    assert len(half.node_chunk) == len(set(np.array(pairs["chunk_id"])[first]))

    questions = derive_index(index, nodes="q", embedder=embedder)
    kept = [q for q, k in zip(pairs["question"], pairs["kept"]) if k]
    assert np.allclose(questions.node_embeddings, embedder.encode(kept), atol=1e-6)
    assert questions.manifest["settings"]["nodes"]["nodes"] == "q"


class FaultyJudge:
    """The real backend, except that the judge's first reply has no verdict and its second request fails."""

    def __init__(self, backend):
        self.backend, self.model_name = backend, backend.model_name

    def chat(self, conversations, sampling):
        completions = self.backend.chat(conversations, sampling)
        if len(completions) >= 2:
            completions[0] = Completion(text="I cannot grade this.")
            completions[1] = Completion(error="timed out")
        return completions


def test_eval_answers_judges_and_reports(small_index, questions_file, vllm_backend, embedder, tmp_path):
    index = QCGIndex.load(small_index)
    doc_ids = set(index.chunks.column("doc_id").to_pylist())
    assert {"20260105_1400", "20260106_0900"} <= doc_ids
    evalset = load_dataset("jsonl", questions_file)
    harness = Harness(
        index,
        evalset,
        embedder,
        RetrievalConfig(gamma=1.0),
        Answering(vllm_backend, AnswerConfig(max_answer_tokens=48), judge=FaultyJudge(vllm_backend)),
    )
    evaluation = harness.run(EvalConfig(methods="naive,d2q,d2q-minus,qcg,qcg-q", sweeps="hops,knn"))

    records = evaluation.records
    assert [r["method"] for r in records] == [
        m for m in ("naive", "d2q", "d2q-minus", "qcg", "qcg-q") for _ in QUESTIONS
    ]
    for r in records:
        assert 0 < len(r["chunk_ids"]) <= 5
        assert r["docs"] == [index.chunks.column("doc_id")[c].as_py() for c in r["chunk_ids"]]
        assert isinstance(r["answer"], str) and r["answer"] or r.get("error")
        assert r["judge"] in (0.0, 1.0) and r["em"] in (0.0, 1.0) and 0.0 <= r["f1"] <= 1.0
        if r["type"] == "null":
            assert r["judge"] == r["em"] == float(r["abstained"]) and np.isnan(r["R@5"])
        else:
            assert r["R@5"] == evidence_recall(r["docs"], r["evidence"])
            assert ("judge_reply" in r) == (bool(r["answer"]) and not r["abstained"])
            if r["abstained"]:
                assert r["judge"] == 0.0
    # naive RAG: every chunk of the small index is scored, so top-5 equals a brute-force ranking
    naive = [r for r in records if r["method"] == "naive"]
    chunk_emb = load_array(small_index, "chunk_embeddings")
    sims = harness.vectors @ chunk_emb.T
    assert [r["chunk_ids"] for r in naive] == [list(np.argsort(-s, kind="stable")[:5]) for s in sims]
    # qcg: the same chunks as the retriever on its own
    qcg_ids = Retriever(index, RetrievalConfig(gamma=1.0)).search(harness.vectors).chunk_ids
    assert [r["chunk_ids"] for r in records if r["method"] == "qcg"] == [
        [c for c in row if c >= 0] for row in qcg_ids.tolist()
    ]
    judged = [r for r in records if "judge_reply" in r]
    failed = [r for r in judged if r.get("judge_error")]  # the fault's second reply
    assert len(failed) == 1 and failed[0]["judge_error"] == "timed out"
    assert failed[0]["judge_reply"] is None and failed[0]["judge"] == 0.0
    assert any(r.get("judge_unparsed") and r["judge"] == 0.0 for r in judged)  # the fault's first

    assert [row["hops"] for row in evaluation.sweeps["hops"]] == [0, 1, 2]
    assert [row["knn_k"] for row in evaluation.sweeps["knn"]] == [1, 2, 3, 4, 5]
    hop1 = next(row for row in evaluation.sweeps["hops"] if row["hops"] == 1)
    qcg_row = next(row for row in summarize(records, evaluation.types) if row["method"] == "qcg")
    assert (
        hop1["R@5"] == qcg_row["R@5"] and hop1["RR@5"] == qcg_row["RR@5"]
    )  # the sweep's default point is the main run

    paths = write_report(evaluation, tmp_path / "report", {"dataset": "fixture"}, ["a problem"], "naive")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    compared = {(r["method"], r["metric"]): r for r in csv.DictReader(open(tmp_path / "report" / "comparisons.csv"))}
    assert {method for method, _ in compared} == {"d2q", "d2q-minus", "qcg", "qcg-q"}
    # each row pairs the questions both scored: every one for answers, those with evidence for retrieval
    scored = {"judge": 3, "judge_single": 2, "judge_null": 1, "f1": 3, "R@5": 2, "R@5_single": 2}
    for method in ("d2q", "qcg", "qcg-q"):
        assert {metric: int(compared[(method, metric)]["questions"]) for metric in scored} == scored
        assert (method, "R@5_null") not in compared  # no evidence: nothing to compare
    lines = [json.loads(line) for line in (tmp_path / "report" / "results.jsonl").read_text().splitlines()]
    assert len(lines) == len(records) and lines[-1]["R@5"] is None  # NaN written as null: valid JSON
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "LLM-as-judge accuracy" in summary and "| qcg-q |" in summary and "a problem" in summary
    unparsed = sum(1 for r in records if r.get("judge_unparsed"))  # the fault's one, plus any of the small model's own
    assert (
        f"judge replies without a verdict: {unparsed}, failed judge requests: 1, failed answer requests: 0" in summary
    )
    assert (tmp_path / "report" / "sweep_knn.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_cli_retrieval_only(small_index, questions_file, tmp_path, cli):
    out = tmp_path / "report"
    result = cli(
        "eval",
        "--dataset",
        "jsonl",
        "--data",
        questions_file,
        "--index",
        small_index,
        "--out",
        out,
        "--no-answers",
        "--methods",
        "naive,qcg",
        "--sweeps",
        "seeds",
        "--gamma",
        "1.0",
        "--quiet",
        "--compare-index",
        f"again={small_index}",
        "--limit-per-type",
        "1",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Evidence recall, R@5" in result.stdout and "LLM-as-judge" not in result.stdout
    assert "Evidence recall, R@5_" not in result.stdout  # one table per metric, its types as columns
    assert "| qcg@again |" in result.stdout and "questions by type: {'single': 1, 'null': 1}" in result.stdout
    assert "retrieval metrics over the 1 of 2 questions that name evidence documents" in result.stdout
    assert [int(r["with_evidence"]) for r in csv.DictReader(open(out / "summary.csv"))] == [1, 1, 1, 1]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == [
        "naive",
        "naive",
        "qcg",
        "qcg",
        "naive@again",
        "naive@again",
        "qcg@again",
        "qcg@again",
    ]
    assert [r["chunk_ids"] for r in records[:4]] == [r["chunk_ids"] for r in records[4:]]  # the same index twice
    # TREC files: trec_eval's R@5 and RR@5 on the qcg run equal ours (questions with evidence only)
    ir_measures = pytest.importorskip("ir_measures")
    qrels = list(ir_measures.read_trec_qrels(str(out / "qrels.documents.txt")))
    run = list(ir_measures.read_trec_run(str(out / "runs" / "qcg.documents.run")))
    theirs = ir_measures.calc_aggregate([ir_measures.R @ 5, ir_measures.RR @ 5], qrels, run)
    mine = [r for r in records if r["method"] == "qcg" and r["evidence"]]
    assert mine and theirs[ir_measures.R @ 5] == pytest.approx(np.mean([r["R@5"] for r in mine]))
    assert theirs[ir_measures.RR @ 5] == pytest.approx(np.mean([r["RR@5"] for r in mine]))
    assert (out / "runs" / "naive@again.chunks.run").exists() and (out / "qrels.chunks.txt").read_text()
    rows = (out / "sweep_seeds.csv").read_text().splitlines()
    assert rows[0].startswith("gamma,n,") and len(rows) == 1 + 8
    for point in csv.DictReader(open(out / "sweep_seeds.csv")):  # each point with its interval (error bars)
        assert float(point["R@5_ci_low"]) <= float(point["R@5"]) <= float(point["R@5_ci_high"])
    assert "8 settings tried; the best by R@5" in result.stdout and "selected on these questions" in result.stdout
    assert (out / "sweep_seeds.png").exists()
    # a compared index's rows are compared with the baseline too; the same index twice: no difference
    compared = {(r["method"], r["metric"]): r for r in csv.DictReader(open(out / "comparisons.csv"))}
    assert float(compared[("qcg@again", "R@5")]["delta"]) == float(compared[("qcg", "R@5")]["delta"])
    assert (
        float(compared[("naive@again", "R@5")]["delta"]) == 0 and compared[("naive@again", "R@5")]["p_value"] == "1.0"
    )
    assert "### Differences from naive (points)" in result.stdout
    # report.html's data: the main index's QCG trace of each question, its nodes' generated pairs
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert [t["qid"] for t in traces] == [r["qid"] for r in records if r["method"] == "qcg"]
    assert all(n["question"] and n["answer"] for t in traces for n in t["nodes"].values())
    assert (out / "report.html").stat().st_size > 0 and json.loads((out / "run.json").read_text())["sweeps"] == [
        "seeds"
    ]


def test_answer_options_with_no_answers_are_refused_before_any_work(tmp_path, cli):
    """They were ignored without a word: --no-answers --judge-model X, or --answers-out F, ran without them."""
    evaluate = ("eval", "--dataset", "jsonl", "--data", tmp_path / "none", "--index", tmp_path / "none")
    for given in (["--judge-model", "m"], ["--judge", "--answers-out", "a.parquet"], ["--sweep-answers"]):
        result = cli(*evaluate, "--out", tmp_path / "o", "--no-answers", *given)
        assert result.returncode == 2, result.stderr
        flags = ", ".join(g for g in given if g.startswith("--"))
        assert f"qcg: error: {flags}: only for answers, which --no-answers turns off" in result.stderr
    assert not (tmp_path / "o").exists()
    result = cli(*evaluate, "--out", tmp_path / "o", "--no-answers", "--no-judge")  # agrees: refused for the data
    assert "only for answers" not in result.stderr


def test_eval_cli_bad_input(small_index, questions_file, tmp_path, cli):
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "Who?", "answer": "x", "evidence_doc_ids": ["not-a-doc"]}) + "\n")
    result = cli(
        "eval", "--dataset", "jsonl", "--data", wrong, "--index", small_index, "--out", tmp_path / "o", "--no-answers"
    )
    assert result.returncode == 2 and "none of the 1 evidence documents is in" in result.stderr
    partly = tmp_path / "partly.jsonl"  # one question the index can answer, one whose evidence it lacks
    partly.write_text(questions_file.read_text().splitlines()[0] + "\n" + wrong.read_text())
    evaluate = ("eval", "--dataset", "jsonl", "--data", partly, "--index", small_index, "--no-answers", "--quiet")
    result = cli(*evaluate, "--out", tmp_path / "o")
    assert result.returncode == 2 and "1 evidence document of 1 question (counted as misses)" in result.stderr
    assert "--allow-missing-evidence" in result.stderr and not (tmp_path / "o" / "summary.md").exists()
    result = cli(*evaluate, "--out", tmp_path / "o", "--allow-missing-evidence")  # scored as misses, and said
    assert result.returncode == 0, result.stderr[-2000:]
    assert "retrieval metrics over the 2 of 2 questions" in result.stdout and "(counted as misses)" in result.stdout
    result = cli(
        "eval",
        "--dataset",
        "jsonl",
        "--data",
        questions_file,
        "--index",
        small_index,
        "--out",
        tmp_path / "o",
        "--methods",
        "qcg,graphrag",
    )
    assert result.returncode == 2 and "unknown method ['graphrag']" in result.stderr
    result = cli(
        *("eval", "--dataset", "jsonl", "--data", questions_file, "--index", small_index, "--out", tmp_path / "o"),
        *("--compare-index", f"a={small_index}", "--compare-index", f"a={tmp_path}"),
    )  # one label's rows were the second index's, silently
    assert result.returncode == 2 and "--compare-index: the label 'a' is given twice" in result.stderr
    result = cli("eval", "--dataset", "jsonl", "--data", questions_file, "--index", tmp_path, "--out", tmp_path / "o")
    assert result.returncode == 2 and "is not a qcg index" in result.stderr
    missing = tmp_path / "answers.parquet"
    result = cli(
        *("eval", "--dataset", "jsonl", "--data", questions_file, "--index", small_index, "--out", tmp_path / "o"),
        *("--answers-in", missing),
    )
    assert result.returncode == 2 and f"stored answers file not found: {missing}" in result.stderr
    result = cli(
        *("eval", "--dataset", "jsonl", "--data", questions_file, "--index", small_index, "--out", tmp_path / "o"),
        *("--model", tmp_path / "no-such-model", "--answers-cache", tmp_path / "a.sqlite"),
    )  # refused before the retrieval, and before any engine could start
    assert result.returncode == 2 and "model path does not exist" in result.stderr
    (tmp_path / "a-file").write_text("")
    result = cli(
        *("eval", "--dataset", "jsonl", "--data", questions_file, "--index", tmp_path / "no-index"),
        *("--out", tmp_path / "a-file" / "report"),
    )  # refused before the index is even looked at
    assert result.returncode == 2 and "--out" in result.stderr and "cannot make that folder" in result.stderr


class Unreachable:
    """An LLM whose every request fails (a server that is down), and that must not be asked to judge."""

    model_name = "down"

    def __init__(self):
        self.asked = 0

    def chat(self, conversations, sampling):
        self.asked += 1
        return [Completion(error="APIConnectionError: connection refused") for _ in conversations]


def test_failed_answers_count_as_incorrect_never_as_abstentions(small_index, questions_file, embedder):
    llm = Unreachable()
    harness = Harness(
        QCGIndex.load(small_index),
        load_dataset("jsonl", questions_file),
        embedder,
        RetrievalConfig(gamma=1.0),
        Answering(llm),
    )
    records = harness.run(EvalConfig(methods="naive")).records
    assert llm.asked == 1  # one batched answering call, no judge call for failed answers
    assert all(r["error"].startswith("APIConnectionError") and not r["abstained"] for r in records)
    assert [r["judge"] for r in records] == [0.0, 0.0, 0.0]  # the Null question too


def test_answers_without_judging_leave_every_judge_value_empty(small_index, questions_file, vllm_backend, embedder):
    """With judging off no question is judged, Null ones included: the judge column must not hold Null questions
    alone."""
    harness = Harness(
        QCGIndex.load(small_index),
        load_dataset("jsonl", questions_file),
        embedder,
        RetrievalConfig(gamma=1.0),
        Answering(vllm_backend),
    )
    records = harness.run(EvalConfig(methods="naive", judge=False)).records
    assert [r["type"] for r in records] == ["single", "single", "null"]
    assert all(np.isnan(r["judge"]) for r in records)
    assert records[2]["em"] == float(records[2]["abstained"])  # the Null question is still scored by abstaining
    row = summarize(records, ["single", "null"])[0]
    assert np.isnan(row["judge"]) and np.isnan(row["judge_null"])


class Streaming(LLMBackend):
    """The real engine, streaming its replies; counts the conversations of each call and, with ``dies``, is
    killed after its first finished reply (a run stopped midway)."""

    def __init__(self, backend, dies: bool = False):
        self.backend, self.model_name, self.dies, self.asked = backend, backend.model_name, dies, []

    def chat_batches(self, conversations, sampling, batch_size):
        self.asked.append(len(conversations))
        stream = self.backend.chat_batches(conversations, sampling, batch_size)
        try:
            for batch in stream:
                yield batch
                if self.dies:
                    raise KeyboardInterrupt
        finally:
            stream.close()  # the engine frees what is still in flight, as when a process ends


def test_a_killed_evaluation_resumes_from_its_shared_answers(
    small_index, questions_file, vllm_backend, embedder, tmp_path, cli
):
    """Answers and judgements are cached as they come and shared in --answers-out: a killed run keeps what it
    finished, a rerun elsewhere (its own cache, the shared file) asks only the rest, and once every reply is
    stored the LLM is not even loaded."""
    index, evalset = QCGIndex.load(small_index), load_dataset("jsonl", questions_file)
    shared = tmp_path / "answers.parquet"

    def evaluate(store: ReplyStore, load):
        llm = CachedLLM(GenerationConfig(batch_chunks=1), store, load)  # one request in flight: a reply per step
        harness = Harness(
            index, evalset, embedder, RetrievalConfig(gamma=1.0), Answering(llm, AnswerConfig(max_answer_tokens=24))
        )
        try:
            return harness.run(EvalConfig(methods="naive,qcg")).records, llm
        finally:
            store.close()

    killed = Streaming(vllm_backend, dies=True)
    with pytest.raises(KeyboardInterrupt):
        evaluate(ReplyStore(tmp_path / "a.sqlite", replies_out=str(shared)), lambda: killed)
    assert pq.read_table(shared).num_rows == 1  # the reply finished before the kill

    resumed = Streaming(vllm_backend)
    records, llm = evaluate(ReplyStore(tmp_path / "b.sqlite", str(shared), str(shared)), lambda: resumed)
    assert resumed.asked[0] == killed.asked[0] - 1  # every distinct answer but the stored one
    assert len(resumed.asked) == 2 and llm.asked == sum(resumed.asked)  # then the judgements
    assert any("judge_reply" in r for r in records)
    assert llm.reused == 2 * len(QUESTIONS) - resumed.asked[0]  # the stored reply, and repeated conversations

    # the command line on a third machine, from the shared file alone: nothing is asked of the LLM
    out = tmp_path / "replayed"
    result = cli(
        *("eval", "--dataset", "jsonl", "--data", questions_file, "--index", small_index, "--out", out, "--quiet"),
        *("--methods", "naive,qcg", "--gamma", "1.0", "--max-answer-tokens", "24"),
        *("--answers-cache", tmp_path / "c.sqlite", "--answers-in", shared),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    judged = sum("judge_reply" in r for r in records)
    assert f"{2 * len(QUESTIONS) + judged} reused from {tmp_path / 'c.sqlite'}, 0 asked of the LLM" in result.stdout
    replayed = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    fields = ("answer", "abstained", "em", "f1", "judge", "judge_reply")
    assert [[r.get(f) for f in fields] for r in replayed] == [[r.get(f) for f in fields] for r in records]
