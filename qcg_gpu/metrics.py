"""Evaluation metrics: retrieval quality without any LLM, answer quality against the gold answer,
and the LLM-as-judge verdict (prompt and robust parsing)."""

from __future__ import annotations

import re
import string
from collections import Counter

# --- retrieval (documents of the top-K chunks vs the question's evidence documents) -------


def evidence_recall(retrieved_docs: list[str], evidence: list[str]) -> float:
    """Fraction of the evidence documents among the retrieved chunks' documents."""
    wanted = set(evidence)
    return len(wanted & set(retrieved_docs)) / len(wanted) if wanted else float("nan")


def all_evidence_hit(retrieved_docs: list[str], evidence: list[str]) -> float:
    """1 when every evidence document was retrieved."""
    return float(set(evidence) <= set(retrieved_docs)) if evidence else float("nan")


def reciprocal_rank(retrieved_docs: list[str], evidence: list[str]) -> float:
    """1 / rank of the first retrieved chunk from an evidence document (0 when none is)."""
    if not evidence:
        return float("nan")
    wanted = set(evidence)
    return next((1.0 / rank for rank, doc in enumerate(retrieved_docs, 1) if doc in wanted), 0.0)


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
