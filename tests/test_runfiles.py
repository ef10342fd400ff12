"""TREC run and qrels files, and our retrieval metrics against trec_eval's (through ir_measures) on them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qcg_gpu.eval.metrics import retrieval_scores
from qcg_gpu.eval.runfiles import chunk_docno, document_ranking, write_qrels, write_run


def test_a_document_ranks_at_its_best_chunk():
    assert document_ranking(["a", "b", "a", "c", "b"], [0.9, 0.8, 0.7, 0.6, 0.5]) == [
        ("a", 0.9),
        ("b", 0.8),
        ("c", 0.6),
    ]
    assert chunk_docno("week1/20260105_1100", 3) == "week1/20260105_1100#3"


def test_run_and_qrels_lines(tmp_path):
    run = write_run(tmp_path / "runs" / "x.run", {"q 1": [("doc a", 0.5), ("b", 0.25)]}, "qcg")
    assert run.read_text() == "q%201 Q0 doc%20a 1 0.5 qcg\nq%201 Q0 b 2 0.25 qcg\n"  # whitespace would split a line
    qrels = write_qrels(tmp_path / "qrels.txt", {"1": ["a", "b", "a"], "2": []})
    assert qrels.read_text() == "1 0 a 1\n1 0 b 1\n"


def test_our_metrics_equal_trec_eval_on_our_run_files(tmp_path):
    ir_measures = pytest.importorskip("ir_measures")
    rng = np.random.default_rng(3)
    corpus = [f"week{w}/doc{d}" for w in range(3) for d in range(8)]
    k, rankings, evidence, ours = 5, {}, {}, {}
    for q in range(300):
        qid = str(q)
        chunk_docs = list(rng.choice(corpus, size=rng.integers(0, k + 1)))  # top-K chunks: documents repeat
        scores = sorted(rng.random(len(chunk_docs)), reverse=True)
        evidence[qid] = list(rng.choice(corpus, size=rng.integers(1, 8), replace=False))
        rankings[qid] = document_ranking(chunk_docs, scores)
        ours[qid] = retrieval_scores(chunk_docs, evidence[qid], k)
    write_run(tmp_path / "run", rankings, "test")
    write_qrels(tmp_path / "qrels", evidence)
    names = ["R@5", "RR@5", "nDCG@5", "AP@5", "Success@5"]
    measures = [ir_measures.parse_measure(name) for name in names]
    theirs = {name: {} for name in names}
    qrels = list(ir_measures.read_trec_qrels(str(tmp_path / "qrels")))
    run = list(ir_measures.read_trec_run(str(tmp_path / "run")))
    for metric in ir_measures.iter_calc(measures, qrels, run):
        theirs[str(metric.measure)][metric.query_id] = metric.value
    for name in names:
        for qid, values in ours.items():
            # trec_eval leaves out a query its run does not rank: every measure is 0 there
            assert math.isclose(values[name], theirs[name].get(qid, 0.0), abs_tol=1e-9), (name, qid)
    assert 0 < np.mean([v["R@5"] for v in ours.values()]) < 1
