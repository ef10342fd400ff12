"""Evaluation datasets in their published formats, as one list of :class:`Question` each.

* ``lihuaworld``: a directory with ``docs/<folder>/<stamp>.txt`` and a questions JSON
  (``{"0": {"question", "answer", "evidence": "k1<and>k2", "type"}}``, MiniRAG's format);
* ``multihop-rag``: a directory with ``corpus.json`` and ``MultiHopRAG.json``;
* ``jsonl``: one ``{"question", "answer", "evidence_doc_ids", "type", "query_id"?}`` per line;
* ``beir``: a BEIR directory: ``corpus.jsonl`` ({_id, title, text}), ``queries.jsonl`` ({_id, text})
  and ``qrels/test.tsv`` (or dev/train; give the .tsv to choose): graded relevance > 0 is evidence;
* ``hipporag``: HippoRAG 2's layout (2WikiMultiHopQA, MuSiQue, HotpotQA, ...): ``NAME.json``, a list
  of questions with their gold answers (``answer``, ``answer_aliases``, ``possible_answers``) and
  supporting passages (``supporting_facts`` + ``context``, ``paragraphs`` or ``contexts`` with
  ``is_supporting``), beside ``NAME_corpus.json``, a list of {title, text} passages.

BEIR and HippoRAG corpora are indexed as they are (``qcg index build corpus.jsonl|NAME_corpus.json
OUT``): qcg_gpu/indexing/documents.py names their documents the way these loaders resolve evidence.

Evidence is resolved to the doc ids the index builder gives the corpus, so metrics compare
like with like. Flaws of the published data are repaired where the intent is clear and
reported in ``EvalSet.problems``; nothing is dropped silently.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QCGError
from ..indexing.documents import RecordNamer, is_unicode, record_text

DATASETS = ("lihuaworld", "multihop-rag", "jsonl", "beir", "hipporag")
NULL_TYPE = "null"  # questions whose correct answer is to abstain
UNTYPED = "untyped"  # a JSONL question that names neither its type nor its evidence


@dataclass
class Question:
    qid: str
    question: str
    answer: str
    evidence: list[str]  # doc ids, as the index builder names the corpus's documents
    type: str  # lower case: single / multi / null (LiHuaWorld), inference / comparison / temporal / null (MultiHop-RAG)
    aliases: list[str] = field(default_factory=list)  # other accepted answers: EM and F1 take the best

    @property
    def answers(self) -> list[str]:
        return [self.answer, *self.aliases]


@dataclass
class EvalSet:
    name: str
    questions: list[Question]
    problems: list[str] = field(default_factory=list)  # flaws found in the data and what was done about each


def load_dataset(name: str, path: str | Path) -> EvalSet:
    loaders = {
        "lihuaworld": load_lihuaworld,
        "multihop-rag": load_multihop_rag,
        "jsonl": load_jsonl,
        "beir": load_beir,
        "hipporag": load_hipporag,
    }
    if name not in loaders:
        raise QCGError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})")
    path = Path(path)
    if not path.exists():
        raise QCGError(f"{name} data not found: {path}")
    evalset = loaders[name](path)
    if not evalset.questions:
        raise QCGError(
            f"no questions in {name} data {path}" + (f" ({evalset.problems[0]}, ...)" if evalset.problems else "")
        )
    check_query_texts([q.qid for q in evalset.questions], [q.question for q in evalset.questions], path)
    return evalset


def check_query_texts(ids: list[str], texts: list[str], source: str | Path) -> None:
    """One line for a query id given twice (results, run files and paired tests are matched by id), or an
    id or text that is not Unicode (JSON can escape half a surrogate pair): the embedder would crash."""
    broken = next((i for i, (qid, text) in enumerate(zip(ids, texts)) if not is_unicode(qid + text)), None)
    if broken is not None:
        raise QCGError(f"{source}: query {broken + 1} holds a lone surrogate (half a UTF-16 pair), not Unicode text")
    repeated = next((qid for qid, count in Counter(ids).items() if count > 1), None)
    if repeated is not None:
        raise QCGError(
            f"{source}: query id {repeated!r} is given {ids.count(repeated)} times; each query needs its own"
        )


def without_evidence(evalset: EvalSet) -> list[Question]:
    """Questions of an answerable type left with no evidence document (their keys named none of the
    corpus): retrieval metrics cannot score them."""
    return [q for q in evalset.questions if not q.evidence and q.type not in (NULL_TYPE, UNTYPED)]


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
    articles = [a for a in corpus if _article_problem(a) is None]  # those qcg corpus writes
    by_url = {a["url"]: multihop_doc_id(a) for a in articles if a.get("url")}
    by_title = {a["title"]: multihop_doc_id(a) for a in articles if a.get("title")}
    problems, questions = [], []
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("query"), str) or not record["query"].strip():
            problems.append(f"question {i}: no query string; skipped")
            continue
        evidence = record.get("evidence_list") or []
        if not isinstance(evidence, list) or not all(isinstance(item, dict) for item in evidence):
            problems.append(f"question {i}: evidence_list is not a list of objects; skipped")
            continue
        qtype = str(record.get("question_type", "")).removesuffix("_query").lower() or "unknown"
        doc_ids = []
        for item in evidence:
            doc_id = by_url.get(_text_or_none(item.get("url"))) or by_title.get(_text_or_none(item.get("title")))
            if doc_id is None:
                problems.append(f"question {i}: evidence {item.get('title')!r} is not in corpus.json; ignored")
            elif doc_id not in doc_ids:
                doc_ids.append(doc_id)
        questions.append(
            Question(str(i), record["query"].strip(), str(record.get("answer", "")).strip(), doc_ids, qtype)
        )
    return EvalSet("multihop-rag", questions, problems)


def _text_or_none(value) -> str | None:
    """A record's field where it is a string (JSON may hold a list or an object there), else None."""
    return value if isinstance(value, str) else None


def write_multihop_corpus(path: str | Path, out: str | Path) -> tuple[int, list[str]]:
    """corpus.json -> a JSONL file ``qcg index`` reads ({doc_id, text}), written whole or not at all;
    returns the article count and a line per article left out (no url or title, no body, a repeated id)."""
    path = Path(path)
    corpus = _read_json(path if path.is_file() else path / "corpus.json")
    if not isinstance(corpus, list):
        raise QCGError(f"{path}: corpus.json must hold a JSON list of articles")
    lines, skipped, seen = [], [], set()
    for i, article in enumerate(corpus):
        problem = _article_problem(article)
        doc_id = multihop_doc_id(article) if not problem else ""
        if not problem and doc_id in seen:
            problem = f"repeats the url or title {doc_id!r} (the first is kept)"
        if problem:
            skipped.append(f"article {i}: {problem}")
            continue
        seen.add(doc_id)
        header = [article.get("title"), f"{article.get('source') or ''} {article.get('published_at') or ''}".strip()]
        text = "\n".join([h for h in header if h] + [article["body"]])
        lines.append(json.dumps({"doc_id": doc_id, "text": text}, ensure_ascii=False) + "\n")
    if not lines:
        left_out = f" ({len(skipped)} left out, the first: {skipped[0]})" if skipped else " (an empty list)"
        raise QCGError(f"{path}: no article to write{left_out}")
    partial = Path(f"{out}.partial")
    partial.write_text("".join(lines), encoding="utf-8")
    os.replace(partial, out)  # an existing file is replaced whole, never left half written
    return len(lines), skipped


def _article_problem(article) -> str | None:
    """Why a corpus.json entry cannot be a document, or None."""
    if not isinstance(article, dict):
        return f"not an object ({type(article).__name__})"
    for key in ("url", "title", "body", "source", "published_at"):
        if article.get(key) is not None and not isinstance(article[key], str):
            return f"its {key} is not a string"
    if not multihop_doc_id(article).strip():
        return "no url or title"
    if not (article.get("body") or "").strip():
        return "no body"
    return None


# --- generic JSONL ----------------------------------------------------------------------


def load_jsonl(path: Path) -> EvalSet:
    problems, questions = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
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


# --- BEIR -------------------------------------------------------------------------------


def load_beir(path: Path) -> EvalSet:
    """Questions of a BEIR split: those with a relevant document in its qrels."""
    root = path.parent.parent if path.suffix == ".tsv" else path
    qrels_file = path if path.suffix == ".tsv" else _beir_split(root)
    texts: dict[str, tuple[str, str]] = {}  # query id -> (text, answer)
    for lineno, record in _jsonl_records(root / "queries.jsonl"):
        if not isinstance(record.get("text"), str) or "_id" not in record:
            raise QCGError(f"{root / 'queries.jsonl'}:{lineno}: needs '_id' and a 'text' string")
        answer = (record.get("metadata") or {}).get("answer", "") if isinstance(record.get("metadata"), dict) else ""
        texts[str(record["_id"])] = (record["text"].strip(), str(answer or ""))
    corpus_ids = {str(r["_id"]) for _, r in _jsonl_records(root / "corpus.jsonl") if "_id" in r}
    evidence: dict[str, list[str]] = {}
    problems: list[str] = []
    for lineno, line in enumerate(qrels_file.read_text(encoding="utf-8-sig").splitlines(), 1):
        fields = line.split("\t")
        if lineno == 1 and fields[0] == "query-id" or not line.strip():
            continue
        if len(fields) != 3 or not fields[2].strip().lstrip("-").isdigit():
            raise QCGError(f"{qrels_file}:{lineno}: expected query-id<TAB>corpus-id<TAB>score")
        qid, doc_id, score = fields[0], fields[1], int(fields[2])
        if qid not in texts:
            problems.append(f"{qrels_file.name}:{lineno}: query {qid!r} is not in queries.jsonl; ignored")
        elif doc_id not in corpus_ids:
            problems.append(f"{qrels_file.name}:{lineno}: document {doc_id!r} is not in corpus.jsonl; ignored")
        elif score > 0 and doc_id not in evidence.setdefault(qid, []):
            evidence[qid].append(doc_id)
    questions = [Question(q, texts[q][0], texts[q][1], docs, UNTYPED) for q, docs in evidence.items() if docs]
    if not questions:
        raise QCGError(f"{qrels_file}: no query with a relevant document")
    return EvalSet(f"beir:{root.name}/{qrels_file.stem}", questions, problems)


def _beir_split(root: Path) -> Path:
    for split in ("test", "dev", "train"):
        if (root / "qrels" / f"{split}.tsv").is_file():
            return root / "qrels" / f"{split}.tsv"
    raise QCGError(f"{root}: no qrels/test.tsv, dev.tsv or train.tsv (a BEIR directory, or give the .tsv file)")


def _jsonl_records(path: Path):
    if not path.is_file():
        raise QCGError(f"{path} not found")
    with open(path, encoding="utf-8-sig") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise QCGError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
                if isinstance(record, dict):
                    yield lineno, record


# --- HippoRAG 2 layout ----------------------------------------------------------------


def load_hipporag(path: Path) -> EvalSet:
    """Questions of a HippoRAG-layout dataset, evidence resolved to the corpus's doc ids."""
    questions_file = path if path.is_file() else _hipporag_questions(path)
    corpus_file = questions_file.with_name(questions_file.stem + "_corpus.json")
    corpus, samples = _read_json(corpus_file), _read_json(questions_file)
    if not isinstance(corpus, list) or not isinstance(samples, list):
        raise QCGError(f"{questions_file} and {corpus_file.name} must each hold a JSON list")
    name = RecordNamer()
    by_passage = {record_text(r): name(r) for r in corpus if isinstance(r, dict)}
    problems, questions = [], []
    for i, sample in enumerate(samples):
        where = f"{questions_file.name}[{i}]"
        if not isinstance(sample, dict) or not isinstance(sample.get("question"), str):
            problems.append(f"{where}: no question string; skipped")
            continue
        try:
            answers, supporting = _gold_answers(sample), _supporting_passages(sample)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:  # a field of another shape
            problems.append(
                f"{where}: its answers or supporting passages are malformed ({type(exc).__name__}: {exc}); skipped"
            )
            continue
        if not answers:
            problems.append(f"{where}: no gold answer; skipped")
            continue
        evidence = []
        for spellings in supporting:
            doc_id = next((by_passage[p] for p in spellings if p in by_passage), None)
            if doc_id is None:
                title = spellings[0].split("\n", 1)[0]
                problems.append(f"{where}: supporting passage {title!r} is not in the corpus; ignored")
            elif doc_id not in evidence:
                evidence.append(doc_id)
        qid = str(sample.get("_id", sample.get("id", i)))
        qtype = str(sample.get("type") or (qid.split("__")[0] if "__" in qid else "multi")).lower()
        questions.append(Question(qid, sample["question"].strip(), answers[0], evidence, qtype, answers[1:]))
    if not questions:
        raise QCGError(f"no usable questions in {questions_file}" + (f" ({problems[0]}, ...)" if problems else ""))
    if not any(q.evidence for q in questions):
        raise QCGError(
            f"no supporting passage of any question in {questions_file.name} is in {corpus_file.name}: "
            "is this the corpus the questions were written for?"
        )
    return EvalSet(f"hipporag:{questions_file.stem}", questions, problems)


def _hipporag_questions(root: Path) -> Path:
    corpora = sorted(root.glob("*_corpus.json"))
    candidates = [c.with_name(c.name.removesuffix("_corpus.json") + ".json") for c in corpora]
    found = [c for c in candidates if c.is_file()]
    if len(found) != 1:
        raise QCGError(f"{root}: expected one NAME.json beside NAME_corpus.json, found {[c.name for c in found]}")
    return found[0]


def _gold_answers(sample: dict) -> list[str]:
    """answer (or gold_ans / reference / obj), then answer_aliases and possible_answers, each once."""
    first = next((sample[k] for k in ("answer", "gold_ans", "reference", "obj") if sample.get(k) is not None), None)
    answers = list(first) if isinstance(first, list) else [first] if first is not None else []
    for key in ("answer_aliases", "possible_answers"):
        more = sample.get(key) or []
        answers += [more] if isinstance(more, str) else list(more)
    return list(dict.fromkeys(str(a).strip() for a in answers if str(a).strip()))


def _supporting_passages(sample: dict) -> list[tuple[str, ...]]:
    """Each supporting passage as "title\ntext" (how the corpus's passages read), as HippoRAG finds them;
    HotpotQA's sentences join without spaces, 2WikiMultiHopQA's with: both spellings are tried."""
    if "supporting_facts" in sample:  # HotpotQA, 2WikiMultiHopQA: titles of [title, sentences] contexts
        titles = {fact[0] for fact in sample["supporting_facts"]}
        return [
            (f"{title}\n{''.join(sentences)}", f"{title}\n{' '.join(sentences)}")
            for title, sentences in sample.get("context", [])
            if title in titles
        ]
    key = "contexts" if "contexts" in sample else "paragraphs"
    return [
        (f"{p['title']}\n{p.get('text', p.get('paragraph_text', ''))}",)
        for p in sample.get(key, [])
        if p.get("is_supporting", True)
    ]


def _read_json(path: Path):
    if not path.exists():
        raise QCGError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QCGError(f"{path} is not valid JSON: {exc}") from exc
