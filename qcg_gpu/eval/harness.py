"""``qcg eval``: the paper's benchmark on one index — methods, ablations and sweeps, scored by
retrieval metrics (no LLM needed) and, when an LLM is given, by answer metrics and LLM-as-judge.

Every method sees the same chunks, embedder and K. Node-text ablations and the ``knn`` /
``alpha`` sweeps are derived from the index's stored pairs (qcg_gpu/eval/variants.py), so nothing
is generated again. What a run writes is ``report.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..answer import answer_from_chunks
from ..config import ABLATIONS, BASELINES, INDEX_PARAMETERS, SWEEPS, AnswerConfig, EvalConfig
from ..embedding import Embedder
from ..errors import QCGError
from ..llm.backends import LLMBackend, SamplingSpec
from ..log import counted, logger, progress_bar
from ..retrieval import QCGIndex, RetrievalConfig, RetrievalResult, search, trace_queries
from ..retrieval.trace import readable_traces
from . import significance
from .datasets import NULL_TYPE, EvalSet, without_evidence
from .metrics import (
    best_over,
    exact_match,
    is_abstention,
    judge_conversation,
    parse_verdict,
    retrieval_scores,
    token_f1,
)
from .runfiles import chunk_docno
from .variants import derive_index

ANSWER_METRICS = ("judge", "em", "f1")


@dataclass
class Evaluation:
    records: list[dict]  # one per (method, question)
    sweeps: dict[str, list[dict]]  # sweep name -> one row per point
    types: list[str]
    chunks_of: dict[str, set[str]] = field(default_factory=dict)  # doc id -> its chunks' docnos (chunk qrels)
    traces: dict[str, dict] = field(default_factory=dict)  # qid -> the qcg method's trace (readable_traces)

    def add(self, other: Evaluation, label: str) -> None:
        """Append another index's records, their methods labelled ``METHOD@label``."""
        self.records += [{**r, "method": f"{r['method']}@{label}"} for r in other.records]
        for doc, chunks in other.chunks_of.items():
            self.chunks_of.setdefault(doc, set()).update(chunks)


@dataclass
class Answering:
    """What answer metrics need: the answering LLM, its settings, and the judge (the answering LLM if none)."""

    llm: LLMBackend
    config: AnswerConfig = field(default_factory=AnswerConfig)
    judge: LLMBackend | None = None


class Harness:
    """Holds what every method shares: the index, its embedder, the questions and their embeddings.
    Answer metrics need ``answering``; ``cluster`` (a ``RayCluster``) splits QCG retrieval over its workers."""

    def __init__(
        self,
        index: QCGIndex,
        evalset: EvalSet,
        embedder: Embedder,
        retrieval: RetrievalConfig,
        answering: Answering | None = None,
        cluster=None,
    ):
        self.index, self.evalset, self.embedder = index, evalset, embedder
        self.retrieval = retrieval.validate()
        self.answer_config = (answering.config if answering else AnswerConfig()).validate()
        self.llm = answering.llm if answering else None
        self.judge_llm = (answering.judge or answering.llm) if answering else None
        self.cluster = cluster
        self.questions, self.types = evalset.questions, _type_order(evalset.questions)
        self.vectors = embedder.encode([q.question for q in self.questions], "questions")
        self.doc_ids = index.chunks.column("doc_id").to_pylist()
        self.chunk_docnos = [
            chunk_docno(d, i) for d, i in zip(self.doc_ids, index.chunks.column("chunk_index").to_pylist())
        ]

    def run(self, config: EvalConfig) -> Evaluation:
        records, traces = [], {}
        for method in config.method_list():
            logger.info(f"method {method}")
            result = self.retrieve(method, self.index, self.retrieval)
            records += self.score_retrieval(method, result)
            if method == "qcg" and self.index.nodes_loaded:
                traces = self.traces(result)
            elif method == "qcg":
                logger.info("no QCG traces: the node arrays are on the Ray workers (--ray-mode queries records them)")
        if config.answers:
            self.score_answers(records, config.judge)
        sweeps = {name: self.sweep(name, config) for name in config.sweep_list()}
        chunks_of: dict[str, set[str]] = {}
        for doc, docno in zip(self.doc_ids, self.chunk_docnos):
            chunks_of.setdefault(doc, set()).add(docno)
        return Evaluation(records, sweeps, self.types, chunks_of, traces)

    def traces(self, result: RetrievalResult) -> dict[str, dict]:
        """Each question's QCG trace (seeds, hops, chunk means, node texts), for report.html."""
        traces = trace_queries(self.index, self.vectors, result, self.retrieval.hops)
        return {q.qid: trace for q, trace in zip(self.questions, readable_traces(self.index, traces))}

    def retrieve(self, method: str, index: QCGIndex, retrieval: RetrievalConfig) -> RetrievalResult:
        """Every question's top-K chunks and their scores."""
        if method in BASELINES:
            return search(index, self.vectors, retrieval, method, self.embedder)
        if method in ABLATIONS:
            index = derive_index(index, nodes=method.removeprefix("qcg-"), embedder=self.embedder)
        return search(index, self.vectors, retrieval, cluster=self.cluster)

    def score_retrieval(self, method: str, result: RetrievalResult, setting: dict | None = None) -> list[dict]:
        """One record per question: its ranking (chunk ids, docnos, documents, scores) and retrieval metrics."""
        records = []
        for question, row, row_scores in zip(self.questions, result.chunk_ids, result.scores):
            ranked = [int(c) for c in row if c >= 0]
            docs = [self.doc_ids[c] for c in ranked]
            records.append(
                {
                    "method": method,
                    **({"setting": setting} if setting else {}),
                    "qid": question.qid,
                    "type": question.type,
                    "question": question.question,
                    "gold": question.answer,
                    **({"gold_aliases": question.aliases} if question.aliases else {}),
                    "evidence": question.evidence,
                    "chunk_ids": ranked,
                    "chunks": [self.chunk_docnos[c] for c in ranked],
                    "docs": docs,
                    "scores": [round(float(s), 6) for s in row_scores[: len(ranked)]],
                    **retrieval_scores(docs, question.evidence, len(row)),
                }
            )
        return records

    def score_answers(self, records: list[dict], judge: bool) -> None:
        """Answer every record's question from its chunks in one batched LLM call, then score it.

        Null questions are correct exactly when the answer abstains; an abstention on any other
        question is incorrect without asking the judge."""
        if self.llm is None:
            raise QCGError("answer metrics need an LLM (or turn them off with --no-answers)")
        logger.info(f"answering {len(records)} questions")
        # question by question across methods: a run stopped midway (its answers are kept, qcg_gpu/llm/cache.py)
        # leaves every method's answers to the same questions
        position = {q.qid: i for i, q in enumerate(self.questions)}
        records = sorted(records, key=lambda r: position.get(r["qid"], 0))
        completions = answer_from_chunks(
            self.llm,
            [r["question"] for r in records],
            [r["chunk_ids"] for r in records],
            self.index.chunk_texts(),
            self.answer_config,
        )
        to_judge = []
        for record, completion in zip(records, completions):
            answer = "" if completion.error else completion.text.strip()
            abstained = is_abstention(answer)  # a failed request or an empty reply is not an abstention
            record.update(
                answer=answer, abstained=abstained, **({"error": completion.error} if completion.error else {})
            )
            if (
                record["type"] == NULL_TYPE
            ):  # correct exactly when it abstains; judged (by that rule) only if judging is on
                record.update(
                    em=float(abstained), f1=float(abstained), judge=float(abstained) if judge else float("nan")
                )
                continue
            golds = [record["gold"], *record.get("gold_aliases", [])]  # several accepted answers: the best counts
            record.update(
                em=best_over(exact_match, answer, golds),
                f1=best_over(token_f1, answer, golds),
                judge=0.0 if judge else float("nan"),
            )
            if judge and answer and not abstained:
                to_judge.append(record)
        if to_judge:
            logger.info(f"judging {len(to_judge)} answers")
            self._judge(to_judge)

    def _judge(self, records: list[dict]) -> None:
        sampling = SamplingSpec(temperature=0.0, top_p=1.0, max_tokens=8, seed=0)
        conversations = [judge_conversation(r["question"], r["gold"], r["answer"]) for r in records]
        assert self.judge_llm is not None  # score_answers refuses to run without an LLM
        for record, completion in zip(records, self.judge_llm.chat(conversations, sampling)):
            if completion.error:
                record.update(
                    judge=0.0, judge_reply=None, judge_error=completion.error
                )  # counted incorrect, and reported
                continue
            verdict = parse_verdict(completion.text)
            record.update(judge=float(bool(verdict)), judge_reply=completion.text.strip())
            if verdict is None:
                record["judge_unparsed"] = True  # counted incorrect, and reported

    def sweep(self, name: str, config: EvalConfig) -> list[dict]:
        """One row per point: summary.csv's columns, and a 95% bootstrap interval (``METRIC_ci_low`` and
        ``_ci_high``) for each metric overall, drawn as error bars in the plot."""
        rows: list[dict] = []
        rng = np.random.default_rng(significance.SEED)
        variant, variant_key = self.index, dict[str, float]()
        for point in progress_bar(SWEEPS[name], desc=f"sweep {name}"):
            index_params = {k: v for k, v in point.items() if k in INDEX_PARAMETERS}
            if index_params != variant_key:  # derive each index variant once, in sweep order
                variant = derive_index(self.index, **index_params) if index_params else self.index
                variant_key = index_params
            retrieval = replace(self.retrieval, **{k: v for k, v in point.items() if k not in INDEX_PARAMETERS})
            records = self.score_retrieval("qcg", self.retrieve("qcg", variant, retrieval), point)
            if config.sweep_answers and config.answers:
                self.score_answers(records, config.judge)
            row = {**point, **summarize(records, self.types)[0]}
            for metric in metric_names(records):
                values = np.array([r[metric] for r in records if significance.is_number(r.get(metric))])
                row[f"{metric}_ci_low"], row[f"{metric}_ci_high"] = significance.mean_ci(values, rng)
            rows.append(row)
        return rows


def _type_order(questions) -> list[str]:
    return sorted({q.type for q in questions}, key=lambda t: (t == NULL_TYPE, t))


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(records: list[dict], types: list[str]) -> list[dict]:
    """One row per method: each metric overall and per question type (NaN where it does not apply)."""
    rows = []
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method]
        row = {"method": method, "questions": len(mine), "with_evidence": sum(1 for r in mine if r["evidence"])}
        for metric in metric_names(mine):
            row[metric] = _mean(r.get(metric) for r in mine)
            for qtype in types:
                row[f"{metric}_{qtype}"] = _mean(r.get(metric) for r in mine if r["type"] == qtype)
        rows.append(row)
    return rows


def metric_names(records: list[dict]) -> list[str]:
    """The metrics the records carry, answer metrics first (the paper's order), then retrieval ones (``R@5``...)."""
    keys = dict.fromkeys(key for r in records for key in r)
    return [m for m in ANSWER_METRICS if m in keys] + [
        k for k in keys if k.partition("@")[2].isdigit()
    ]  # not R@5_multi


def check_evidence(index: QCGIndex, evalset: EvalSet, allow_missing: bool = False) -> list[str]:
    """Refuse a run whose retrieval metrics would silently score another question set than the dataset's:
    evidence documents the index does not hold (all of them: the wrong index), or answerable questions left
    without evidence. With ``allow_missing``, only the wrong index is refused; the rest is reported."""
    in_index = set(index.chunks.column("doc_id").to_pylist())
    evidence = {doc for q in evalset.questions for doc in q.evidence}
    missing = sorted(evidence - in_index)
    if evidence and len(missing) == len(evidence):
        raise QCGError(
            f"none of the {len(evidence)} evidence documents is in {index.path}: was it built from this dataset's "
            f"corpus? "
            f"(evidence e.g. {missing[0]!r}, index e.g. {next(iter(in_index), None)!r})"
        )
    unscored = without_evidence(evalset)
    if not evidence and not allow_missing:
        raise QCGError(f"no question of {evalset.name} names an evidence document: nothing to score retrieval by")
    problems = []
    if missing:
        hit = sum(1 for q in evalset.questions if set(q.evidence) & set(missing))
        problems.append(
            f"not in {index.path}: {counted(len(missing), 'evidence document')} of {counted(hit, 'question')} "
            f"(counted as misses), e.g. {missing[:3]}"
        )
    if unscored:
        problems.append(
            f"no evidence document in the corpus: {counted(len(unscored), 'question')} "
            f"(left out of retrieval metrics), e.g. {unscored[0].qid}"
        )
    if problems and not allow_missing:
        raise QCGError("; ".join(problems) + ". Index the whole corpus, or pass --allow-missing-evidence")
    return problems
