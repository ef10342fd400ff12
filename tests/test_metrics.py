"""Metrics on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from qcg_gpu.eval.metrics import (
    all_evidence_hit,
    average_precision,
    evidence_recall,
    exact_match,
    is_abstention,
    ndcg,
    normalize_answer,
    parse_verdict,
    reciprocal_rank,
    success,
    token_f1,
)


def test_retrieval_metrics():
    docs = ["d3", "d1", "d3", "d7"]  # documents of the top-4 chunks, best first (a document may repeat)
    assert evidence_recall(docs, ["d1", "d2"]) == 0.5
    assert evidence_recall(docs, ["d1", "d7"]) == 1.0
    assert all_evidence_hit(docs, ["d1", "d2"]) == 0.0 and all_evidence_hit(docs, ["d7", "d3"]) == 1.0
    assert reciprocal_rank(docs, ["d1", "d2"]) == 0.5
    assert reciprocal_rank(docs, ["d7"]) == 1 / 3  # documents rank at their best chunk: d3, d1, d7
    assert ndcg(docs, ["d1", "d7"], 4) == (1 / math.log2(3) + 1 / 2) / (1 + 1 / math.log2(3))
    assert average_precision(docs, ["d1", "d7", "d9"], 4) == (1 / 2 + 2 / 3) / 3
    assert success(docs, ["d9", "d7"]) == 1.0 and success(docs, ["d9"]) == 0.0
    assert reciprocal_rank(docs, ["d9"]) == 0.0 and evidence_recall([], ["d9"]) == 0.0
    # no evidence (Null questions): the metrics do not apply
    assert all(math.isnan(f(docs, [])) for f in (evidence_recall, all_evidence_hit, reciprocal_rank, success))
    assert math.isnan(ndcg(docs, [], 4)) and math.isnan(average_precision(docs, [], 4))


def test_answer_metrics():
    assert normalize_answer("The  Cozy Café, downtown!") == "cozy café downtown"
    assert exact_match("5:30 PM.", "530 pm") == 1.0 and exact_match("5:30", "5:30 PM") == 0.0
    # pred "keep noise low late" vs gold "keep noise to a minimum during late hours": 3 common tokens
    assert token_f1("keep noise low late", "keep noise to a minimum during late hours") == pytest.approx(
        2 * (3 / 4) * (3 / 7) / (3 / 4 + 3 / 7)
    )
    assert token_f1("", "") == 1.0 and token_f1("yes", "") == 0.0 and token_f1("blue", "red") == 0.0
    assert token_f1("Yes", "yes") == 1.0


@pytest.mark.parametrize(
    "answer",
    [
        "Insufficient information.",
        "insufficient information",
        "The excerpts do not mention this.",
        "I don't know.",
        "It cannot be determined from the documents.",
        "There is not enough information to answer.",
        "No information is given about the mayor.",
        "The date is not mentioned in the conversations.",
        "The provided context does not specify the time.",
        "There is no mention of a dog.",
    ],
)
def test_abstentions(answer):
    assert is_abstention(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "Yes",
        "5:30 PM",
        "A community planting day",
        "Information desk at 9 am",
        # statements about people and things in the sources, not about the sources
        "Adam does not mention any pets.",
        "The caller used an unknown number.",
        "Wolfgang did not say when he would arrive; LiHua suggested 6 pm.",
    ],
)
def test_answers_that_do_not_abstain(answer):
    assert not is_abstention(answer)


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("correct", True),
        ("Correct.", True),
        ("**Incorrect**", False),
        ("incorrect - the date differs", False),
        ("Verdict: correct", True),
        ("Verdict: no", False),
        ("The answer is not correct.", False),
        ("Yes, it matches.", True),
        ("", None),
        ("I cannot grade this.", None),
        # a grade word decides wherever it stands, over yes/no-like words before it
        ("No contradiction, correct", True),
        ("True, the answer is incorrect", False),
        ("No. Incorrect.", False),
        ("Incorrect. The correct answer is 5 pm.", False),
        ("Not correct", False),
    ],
)
def test_judge_verdicts(reply, verdict):
    assert parse_verdict(reply) is verdict
