"""Evaluation metrics: retrieval quality without any LLM, answer quality against the gold answer,
and the LLM-as-judge verdict (prompt and robust parsing)."""

from __future__ import annotations

import math
import re
import string
from collections import Counter

# --- retrieval (documents of the top-K chunks vs the question's evidence documents) -------
# Each takes the documents of the ranked chunks, best first (a document may repeat: it ranks at its
# first, best, chunk), and the question's evidence documents (binary relevance). Names follow
# ir_measures, with the cutoff K: R@5, RR@5, nDCG@5, AP@5, Success@5; the same values as trec_eval
# gives on our document-level run and qrels files (qcg_gpu/eval/runfiles.py, tested).


def _ranked(retrieved_docs: list[str]) -> list[str]:
    return list(dict.fromkeys(retrieved_docs))


def evidence_recall(retrieved_docs: list[str], evidence: list[str]) -> float:
    """R@K: fraction of the evidence documents among the retrieved chunks' documents."""
    wanted = set(evidence)
    return len(wanted & set(retrieved_docs)) / len(wanted) if wanted else float("nan")


def all_evidence_hit(retrieved_docs: list[str], evidence: list[str]) -> float:
    """AllEvidence@K: 1 when every evidence document was retrieved (what multi-hop questions need)."""
    return float(set(evidence) <= set(retrieved_docs)) if evidence else float("nan")


def success(retrieved_docs: list[str], evidence: list[str]) -> float:
    """Success@K: 1 when any evidence document was retrieved."""
    return float(bool(set(evidence) & set(retrieved_docs))) if evidence else float("nan")


def reciprocal_rank(retrieved_docs: list[str], evidence: list[str]) -> float:
    """RR@K: 1 / rank of the first evidence document (0 when none is)."""
    if not evidence:
        return float("nan")
    wanted = set(evidence)
    return next((1.0 / rank for rank, doc in enumerate(_ranked(retrieved_docs), 1) if doc in wanted), 0.0)


def ndcg(retrieved_docs: list[str], evidence: list[str], k: int) -> float:
    """nDCG@K, binary gains: DCG over the ranked documents / DCG of the ideal ranking."""
    if not evidence:
        return float("nan")
    wanted = set(evidence)
    dcg = sum(1 / math.log2(rank + 1) for rank, doc in enumerate(_ranked(retrieved_docs)[:k], 1) if doc in wanted)
    return dcg / sum(1 / math.log2(rank + 1) for rank in range(1, min(len(wanted), k) + 1))


def average_precision(retrieved_docs: list[str], evidence: list[str], k: int) -> float:
    """AP@K (trec_eval's map_cut): precision at each evidence document's rank <= K, over all evidence."""
    if not evidence:
        return float("nan")
    wanted, hits, total = set(evidence), 0, 0.0
    for rank, doc in enumerate(_ranked(retrieved_docs)[:k], 1):
        if doc in wanted:
            hits += 1
            total += hits / rank
    return total / len(wanted)


RETRIEVAL_METRICS = ("R", "RR", "nDCG", "AP", "Success", "AllEvidence")


def retrieval_scores(retrieved_docs: list[str], evidence: list[str], k: int) -> dict[str, float]:
    """Every retrieval metric of one ranking, named with its cutoff (``R@5``, ...)."""
    values = {
        "R": evidence_recall(retrieved_docs, evidence),
        "RR": reciprocal_rank(retrieved_docs, evidence),
        "nDCG": ndcg(retrieved_docs, evidence, k),
        "AP": average_precision(retrieved_docs, evidence, k),
        "Success": success(retrieved_docs, evidence),
        "AllEvidence": all_evidence_hit(retrieved_docs, evidence),
    }
    return {f"{name}@{k}": values[name] for name in RETRIEVAL_METRICS}


def metric_base(name: str) -> str:
    """``R@5`` -> ``R``; answer metrics have no cutoff."""
    return name.split("@", 1)[0]


# --- answers against the gold answer (SQuAD-style normalisation) --------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_over(metric, prediction: str, golds: list[str]) -> float:
    """A metric against several gold answers: the best of them (NaN when there is none)."""
    return max((metric(prediction, gold) for gold in golds), default=float("nan"))


# What an answer declines on: the sources ("the excerpts do not mention ..."), never a person or a
# thing in them ("Adam does not mention any pets" and "an unknown number" are answers).
_SOURCE = (
    r"(the |these |those )?(given |provided |above )?(text|context|documents?|excerpts?|passages?|conversations?"
    r"|chats?|chunks?|sources?|records?|logs?)"
)
_ABSTENTION = re.compile(
    r"insufficient information|not enough information|no (relevant |such )?information|there is no (mention|record)"
    rf"|{_SOURCE} (does|do|did) not (say|mention|contain|provide|specify|state|include|give)"
    rf"|not (mentioned|specified|provided|stated|given|included) in {_SOURCE}"
    r"|cannot (be )?(determine|answer)|can ?not (be )?(determined|answered)|unable to (determine|answer)|i (do "
    r"not|don't) know"
)


def is_abstention(answer: str) -> bool:
    """Whether an answer declines to answer ("Insufficient information" or an equivalent phrase)."""
    return bool(_ABSTENTION.search(" ".join(answer.lower().replace("’", "'").split())))


# --- LLM as judge ---------------------------------------------------------------------------

JUDGE_SYSTEM_PROMPT = (
    "You grade answers to questions. Given a question, the gold answer and a candidate answer, decide whether "
    "the candidate answer is correct: it states the same fact as the gold answer (wording may differ; extra "
    "detail is fine if it does not contradict the gold answer). Reply with one word: correct or incorrect."
)


def judge_conversation(question: str, gold: str, candidate: str) -> list[dict]:
    return [
        {"role": "system", "content": JUDGE_SYSTEM_PROMPT},
        {
            "role": "user",
            "content": f"Question: {question}\nGold answer: {gold}\nCandidate answer: {candidate}\n\n"
            "Verdict (correct or incorrect):",
        },
    ]


_GRADES = re.compile(r"\b(not correct|incorrect|correct)\b")
_ANSWER_WORDS = {"yes": True, "no": False, "right": True, "wrong": False, "true": True, "false": False}


def parse_verdict(reply: str) -> bool | None:
    """The judge's verdict: its first grade word (``Incorrect.``, ``**Correct**``, ``not correct``) wherever it
    stands, else its first yes/no-like word (``Verdict: no``); None if it has neither.

    Grade words win over yes/no words: "No contradiction, correct" is correct, "True, the answer is
    incorrect" is not."""
    text = reply.lower()
    if grade := _GRADES.search(text):
        return grade.group(1) == "correct"
    return next((_ANSWER_WORDS[w] for w in re.findall(r"[a-z]+", text) if w in _ANSWER_WORDS), None)
