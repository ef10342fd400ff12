"""``qcg eval``: the paper's benchmark on one index — methods, ablations and sweeps, scored by
retrieval metrics (no LLM needed) and, when an LLM is given, by answer metrics and LLM-as-judge.

Every method sees the same chunks, embedder and K. Node-text ablations and the ``knn`` /
``alpha`` sweeps are derived from the index's stored pairs (qcg_gpu/variants.py), so nothing
is generated again. Outputs (see :func:`write_report`): per-question ``results.jsonl``,
``summary.md`` / ``summary.csv`` laid out like the paper's Table 1, and one CSV + PNG per sweep.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .answer import answer_from_chunks
from .config import ABLATIONS, BASELINES, INDEX_PARAMETERS, SWEEPS, AnswerConfig, EvalConfig
from .datasets import NULL_TYPE, EvalSet
from .embedding import Embedder
from .errors import QCGError
from .llm import LLMBackend, SamplingSpec
from .log import logger, progress_bar
from .metrics import (
    all_evidence_hit,
    evidence_recall,
    exact_match,
    is_abstention,
    judge_conversation,
    parse_verdict,
    reciprocal_rank,
    token_f1,
)
from .retrieval import QCGIndex, RetrievalConfig, search
from .variants import derive_index

RETRIEVAL_METRICS = ("recall", "hit", "mrr")
ANSWER_METRICS = ("judge", "em", "f1")


@dataclass
class Evaluation:
    records: list[dict]  # one per (method, question)
    sweeps: dict[str, list[dict]]  # sweep name -> one row per point
    types: list[str]

    def add(self, other: Evaluation, label: str) -> None:
        """Append another index's records, their methods labelled ``METHOD@label``."""
        self.records += [{**r, "method": f"{r['method']}@{label}"} for r in other.records]


class Harness:
    """Holds what every method shares: the index, its embedder, the questions and their embeddings."""

    def __init__(
        self,
        index: QCGIndex,
        evalset: EvalSet,
        embedder: Embedder,
        retrieval: RetrievalConfig,
        answer: AnswerConfig | None = None,
        llm: LLMBackend | None = None,
        judge_llm: LLMBackend | None = None,
        cluster=None,
    ):
        self.index, self.evalset, self.embedder = index, evalset, embedder
        self.retrieval, self.answer_config = retrieval.validate(), (answer or AnswerConfig()).validate()
        self.llm, self.judge_llm = llm, judge_llm or llm
        self.cluster = cluster  # a distributed.RayCluster: QCG retrieval split over its workers
        self.questions, self.types = evalset.questions, _type_order(evalset.questions)
        self.vectors = embedder.encode([q.question for q in self.questions], "questions")
        self.doc_ids = index.chunks.column("doc_id").to_pylist()

    def run(self, config: EvalConfig) -> Evaluation:
        records = []
        for method in config.method_list():
            logger.info(f"method {method}")
            records += self.score_retrieval(method, self.retrieve(method, self.index, self.retrieval))
        if config.answers:
            self.score_answers(records, config.judge)
        sweeps = {name: self.sweep(name, config) for name in config.sweep_list()}
        return Evaluation(records, sweeps, self.types)

    def retrieve(self, method: str, index: QCGIndex, retrieval: RetrievalConfig) -> np.ndarray:
        """(B, K) chunk ids of every question, -1 padded."""
        if method in BASELINES:
            return search(index, self.vectors, retrieval, method, self.embedder).chunk_ids
        if method in ABLATIONS:
            index = derive_index(index, nodes=method.removeprefix("qcg-"), embedder=self.embedder)
        return search(index, self.vectors, retrieval, cluster=self.cluster).chunk_ids

    def score_retrieval(self, method: str, chunk_ids: np.ndarray, setting: dict | None = None) -> list[dict]:
        records = []
        for question, row in zip(self.questions, chunk_ids):
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
                    "evidence": question.evidence,
                    "chunk_ids": ranked,
                    "docs": docs,
                    "recall": evidence_recall(docs, question.evidence),
                    "hit": all_evidence_hit(docs, question.evidence),
                    "mrr": reciprocal_rank(docs, question.evidence),
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
            record.update(
                em=exact_match(answer, record["gold"]),
                f1=token_f1(answer, record["gold"]),
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
        rows: list[dict] = []
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
            rows.append({**point, **summarize(records, self.types)[0]})
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
        row = {"method": method, "questions": len(mine)}
        for metric in RETRIEVAL_METRICS + ANSWER_METRICS:
            if not any(metric in r for r in mine):
                continue
            row[metric] = _mean(r.get(metric) for r in mine)
            for qtype in types:
                row[f"{metric}_{qtype}"] = _mean(r.get(metric) for r in mine if r["type"] == qtype)
        rows.append(row)
    return rows


# --- report ---------------------------------------------------------------------------------

METRIC_TITLES = {
    "judge": "LLM-as-judge accuracy (%)",
    "em": "Exact match (%)",
    "f1": "Token F1 (%)",
    "recall": "Evidence recall@K (%)",
    "hit": "All evidence in top-K (%)",
    "mrr": "MRR of the first evidence chunk (x100)",
}


def _pct(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def markdown_tables(rows: list[dict], types: list[str]) -> str:
    parts = []
    for metric, title in METRIC_TITLES.items():
        if not any(metric in row for row in rows):
            continue
        header = ["method", "overall"] + types
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            cells = [row["method"], _pct(row.get(metric))] + [_pct(row.get(f"{metric}_{t}")) for t in types]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def write_report(evaluation: Evaluation, out: str | Path, header: dict, problems: list[str]) -> list[Path]:
    """results.jsonl, summary.md, summary.csv and sweep_<name>.csv/.png in ``out``; returns the paths."""
    from .plots import plot_sweep

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.jsonl", out / "summary.md", out / "summary.csv"]
    with open(written[0], "w", encoding="utf-8") as fh:
        for record in evaluation.records:
            fh.write(json.dumps(_without_nan(record), ensure_ascii=False) + "\n")
    rows = summarize(evaluation.records, evaluation.types)
    _write_csv(written[2], rows)
    first = [r for r in evaluation.records if r["method"] == rows[0]["method"]] if rows else []
    counts = {t: sum(1 for r in first if r["type"] == t) for t in evaluation.types}
    md = [
        "# Evaluation",
        "",
        *[f"- {key}: {value}" for key, value in header.items()],
        f"- questions by type: {counts}",
        "",
        markdown_tables(rows, evaluation.types),
    ]
    faults = {
        what: sum(1 for r in evaluation.records if r.get(key))
        for key, what in (
            ("judge_unparsed", "judge replies without a verdict"),
            ("judge_error", "failed judge requests"),
            ("error", "failed answer requests"),
        )
    }
    if any(faults.values()):
        md += ["", "Counted incorrect: " + ", ".join(f"{what}: {n}" for what, n in faults.items()) + "."]
    for name, sweep_rows in evaluation.sweeps.items():
        _write_csv(out / f"sweep_{name}.csv", sweep_rows)
        plot_sweep(name, sweep_rows, out / f"sweep_{name}.png")
        written += [out / f"sweep_{name}.csv", out / f"sweep_{name}.png"]
        md += ["", f"### Sweep: {name}", "", f"![{name}](sweep_{name}.png)"]
    if problems:
        md += ["", "### Data problems found and handled", "", *[f"- {p}" for p in problems]]
    written[1].write_text("\n".join(md) + "\n", encoding="utf-8")
    return written


def _without_nan(record: dict) -> dict:
    """NaN (a metric that does not apply) as JSON null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def evidence_outside(index: QCGIndex, evalset: EvalSet) -> list[str]:
    """Evidence documents the index does not hold: a few are data flaws (reported); all of them means the wrong
    index."""
    in_index = set(index.chunks.column("doc_id").to_pylist())
    evidence = {doc for q in evalset.questions for doc in q.evidence}
    missing = sorted(evidence - in_index)
    if evidence and len(missing) == len(evidence):
        raise QCGError(
            f"none of the {len(evidence)} evidence documents is in {index.path}: was it built from this dataset's "
            f"corpus? "
            f"(evidence e.g. {missing[0]!r}, index e.g. {next(iter(in_index), None)!r})"
        )
    return [f"{len(missing)} evidence documents are not in the index, e.g. {missing[:3]}"] if missing else []
