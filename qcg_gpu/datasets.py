"""Evaluation datasets in their published formats, as one list of :class:`Question` each.

* ``lihuaworld``: a directory with ``docs/<folder>/<stamp>.txt`` and a questions JSON
  (``{"0": {"question", "answer", "evidence": "k1<and>k2", "type"}}``, MiniRAG's format);
* ``multihop-rag``: a directory with ``corpus.json`` and ``MultiHopRAG.json``;
* ``jsonl``: one ``{"question", "answer", "evidence_doc_ids", "type", "query_id"?}`` per line.

Evidence is resolved to the doc ids the index builder gives the corpus, so metrics compare
like with like. Flaws of the published data are repaired where the intent is clear and
reported in ``EvalSet.problems``; nothing is dropped silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QCGError

DATASETS = ("lihuaworld", "multihop-rag", "jsonl")
NULL_TYPE = "null"  # questions whose correct answer is to abstain
UNTYPED = "untyped"  # a JSONL question that names neither its type nor its evidence


@dataclass
class Question:
    qid: str
    question: str
    answer: str
    evidence: list[str]  # doc ids, as the index builder names the corpus's documents
    type: str  # lower case: single / multi / null (LiHuaWorld), inference / comparison / temporal / null (MultiHop-RAG)


@dataclass
class EvalSet:
    name: str
    questions: list[Question]
    problems: list[str] = field(default_factory=list)  # flaws found in the data and what was done about each


def load_dataset(name: str, path: str | Path) -> EvalSet:
    loaders = {"lihuaworld": load_lihuaworld, "multihop-rag": load_multihop_rag, "jsonl": load_jsonl}
    if name not in loaders:
        raise QCGError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})")
    path = Path(path)
    if not path.exists():
        raise QCGError(f"{name} data not found: {path}")
    return loaders[name](path)


# --- LiHuaWorld -------------------------------------------------------------------------


def _lihuaworld_files(path: Path) -> tuple[Path, Path]:
    """(questions JSON, docs directory) from the dataset root or the questions file."""
    root = path.parent if path.is_file() else path
    questions = path if path.is_file() else None
    if questions is None:
        candidates = sorted(root.glob("quer*.json"))
        if len(candidates) != 1:
            found = ", ".join(p.name for p in candidates) or "none"
            raise QCGError(
                f"{root}: expected one questions file (query_set.json / queries_*.json), found {found}; pass the file "
                f"itself"
            )
        questions = candidates[0]
    docs = root / "docs"
    if not docs.is_dir():
        raise QCGError(f"{root}: no docs/ directory next to {questions.name}")
    return questions, docs


_EVIDENCE_KEY = re.compile(r"\d{8}(?:_\d\d:?\d\d)?")


def load_lihuaworld(path: Path) -> EvalSet:
    questions_file, docs = _lihuaworld_files(path)
    # an evidence key names a file by its stem: 20260121_10:00 -> docs/weekN/20260121_1000.txt
    doc_by_stem = {p.stem: p.relative_to(docs).with_suffix("").as_posix() for p in docs.rglob("*.txt")}
    records = _read_json(questions_file)
    if not isinstance(records, dict):
        raise QCGError(f"{questions_file}: expected an object of question records keyed by id")
    problems, questions = [], []
    for qid, record in records.items():
        if not isinstance(record, dict) or not all(
            isinstance(record.get(k), str) for k in ("question", "answer", "evidence", "type")
        ):
            problems.append(f"question {qid}: not a record with question/answer/evidence/type strings; skipped")
            continue
        answer, evidence = record["answer"], record["evidence"]
        if "\t" in answer and not _EVIDENCE_KEY.fullmatch(evidence.strip()):
            # published flaw: the evidence key sits in the answer after a tab, junk in the evidence field
            answer, _, evidence = answer.partition("\t")
            problems.append(f"question {qid}: evidence key found in the answer after a tab; moved to evidence")
        qtype = record["type"].strip().lower()
        keys = [] if qtype == NULL_TYPE or evidence.strip() == "N/A" else evidence.split("<and>")
        doc_ids = []
        for key in keys:
            stem = key.strip().removeprefix("Time:").strip().replace(":", "")
            if stem != key.strip().replace(":", ""):
                problems.append(f"question {qid}: evidence key {key.strip()!r} had a stray 'Time:' prefix; removed")
            if stem in doc_by_stem:
                doc_ids.append(doc_by_stem[stem])
            else:
                problems.append(f"question {qid}: evidence key {key.strip()!r} names no document in {docs}; ignored")
        if qtype != NULL_TYPE and not doc_ids:
            problems.append(
                f"question {qid}: no usable evidence; kept for answer metrics, left out of retrieval metrics"
            )
        questions.append(Question(str(qid), record["question"].strip(), answer.strip(), doc_ids, qtype))
    return EvalSet("lihuaworld", questions, problems)


# --- MultiHop-RAG -----------------------------------------------------------------------


def multihop_doc_id(article: dict) -> str:
    """Articles are named by URL (unique in the corpus); the title where a URL is missing."""
    return str(article.get("url") or article.get("title") or "")


def load_multihop_rag(path: Path) -> EvalSet:
    root = path.parent if path.is_file() else path
    corpus = _read_json(root / "corpus.json")
    records = _read_json(path if path.is_file() else root / "MultiHopRAG.json")
    if not isinstance(corpus, list) or not isinstance(records, list):
        raise QCGError(f"{root}: corpus.json and MultiHopRAG.json must each hold a JSON list")
    by_url = {a.get("url"): multihop_doc_id(a) for a in corpus if isinstance(a, dict) and a.get("url")}
    by_title = {a.get("title"): multihop_doc_id(a) for a in corpus if isinstance(a, dict) and a.get("title")}
    problems, questions = [], []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("query"), str) or not record["query"].strip():
            problems.append(f"question {i}: no query string; skipped")
            continue
        qtype = str(record.get("question_type", "")).removesuffix("_query").lower() or "unknown"
        doc_ids = []
        for item in record.get("evidence_list") or []:
            doc_id = by_url.get(item.get("url")) or by_title.get(item.get("title"))
            if doc_id is None:
                problems.append(f"question {i}: evidence {item.get('title')!r} is not in corpus.json; ignored")
            elif doc_id not in doc_ids:
                doc_ids.append(doc_id)
        questions.append(
            Question(str(i), record["query"].strip(), str(record.get("answer", "")).strip(), doc_ids, qtype)
        )
    return EvalSet("multihop-rag", questions, problems)


def write_multihop_corpus(path: str | Path, out: str | Path) -> int:
    """corpus.json -> a JSONL file ``qcg index`` reads ({doc_id, text}); returns the article count."""
    path = Path(path)
    corpus = _read_json(path if path.is_file() else path / "corpus.json")
    if not isinstance(corpus, list):
        raise QCGError(f"{path}: corpus.json must hold a JSON list of articles")
    written = 0
    with open(out, "w", encoding="utf-8") as fh:
        for article in corpus:
            if not isinstance(article, dict) or not multihop_doc_id(article):
                continue
            header = [
                article.get("title", ""),
                f"{article.get('source', '')} {article.get('published_at', '')}".strip(),
            ]
            text = "\n".join([h for h in header if h] + [article.get("body") or ""])
            fh.write(json.dumps({"doc_id": multihop_doc_id(article), "text": text}, ensure_ascii=False) + "\n")
            written += 1
    return written


# --- generic JSONL ----------------------------------------------------------------------


def load_jsonl(path: Path) -> EvalSet:
    problems, questions = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QCGError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("question"), str)
            or not record["question"].strip()
        ):
            raise QCGError(f"{path}:{lineno}: needs a non-empty 'question' string")
        evidence = record.get("evidence_doc_ids") or []
        if not isinstance(evidence, list):
            raise QCGError(f"{path}:{lineno}: 'evidence_doc_ids' must be a list of doc ids")
        qtype = str(record.get("type") or "").strip().lower()
        if not qtype:  # an untyped question with evidence is answerable; without, nothing says it is a Null one
            qtype = "single" if evidence else UNTYPED
            if not evidence:
                problems.append(
                    f"{path.name}:{lineno}: neither 'type' nor 'evidence_doc_ids'; typed {UNTYPED!r} "
                    f'(answer metrics only); give "type": "null" to questions that should be declined'
                )
        questions.append(
            Question(
                str(record.get("query_id", lineno)),
                record["question"].strip(),
                str(record.get("answer", "")).strip(),
                [str(e) for e in evidence],
                qtype,
            )
        )
    if not questions:
        raise QCGError(f"no questions in {path}")
    return EvalSet("jsonl", questions, problems)


def _read_json(path: Path):
    if not path.exists():
        raise QCGError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QCGError(f"{path} is not valid JSON: {exc}") from exc
