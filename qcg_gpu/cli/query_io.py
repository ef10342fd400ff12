"""``qcg query`` / ``qcg answer`` plumbing: read a batch of queries, embed it with the
index's own embedder, retrieve, and describe each result as one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..answer import answer_from_chunks
from ..config import AnswerConfig
from ..errors import QCGError
from ..eval.datasets import check_query_texts
from ..eval.runfiles import Ranking, chunk_docno, document_ranking
from ..retrieval import QCGIndex, RetrievalConfig, RetrievalResult, trace_queries


def write_output(path: str | Path | None, lines: list[str]) -> None:
    """The result lines to --out (stdout without it). If writing fails after all the work (a full disk,
    /dev/full), they go to stdout instead and the error says so: the work is not lost."""
    if path is None:
        sys.stdout.writelines(lines)
        return
    try:
        with open(path, "w") as out:
            out.writelines(lines)
    except OSError as exc:
        sys.stdout.writelines(lines)
        raise QCGError(f"cannot write --out {path} ({exc.strerror}): the results went to stdout instead") from exc


def read_queries(query: str | None = None, path: str | Path | None = None) -> tuple[list[str], list[str]]:
    """(query ids, texts) from one --query or a .txt (a query per line), .jsonl ({query_id?, query|question} per
    line) or .json file (a list of such records or strings, or {id: record}, as LiHuaWorld's queries files)."""
    if query is not None:
        if not query.strip():
            raise QCGError("the query is empty")
        check_query_texts(["0"], [query], "--query")  # bytes that are not UTF-8 reach argv as lone surrogates
        return ["0"], [query.strip()]
    if path is None:
        raise QCGError("give a query or a queries file")
    path = Path(path)
    if not path.exists():
        raise QCGError(f"queries file not found: {path}")
    try:
        content = path.read_text(encoding="utf-8-sig")  # -sig: a byte-order mark (Windows editors) is no text
    except UnicodeDecodeError as exc:
        where = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise QCGError(f"{path}:{where}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); save it as UTF-8") from exc
    except OSError as exc:
        raise QCGError(f"cannot read queries file {path}: {exc.strerror}") from exc
    ids, texts = _json_queries(path, content) if path.suffix == ".json" else _line_queries(path, content)
    if not texts:
        raise QCGError(f"no queries in {path}")
    check_query_texts(ids, texts, path)
    return ids, texts


def _line_queries(path: Path, content: str) -> tuple[list[str], list[str]]:
    ids, texts = [], []
    for lineno, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue  # blank lines carry no query
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QCGError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
            text = record.get("query") or record.get("question") if isinstance(record, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise QCGError(f"{path}:{lineno}: needs a non-empty 'query' (or 'question') string")
            ids.append(str(record.get("query_id", lineno)))
            texts.append(text.strip())
        else:
            ids.append(str(lineno))
            texts.append(line.strip())
    return ids, texts


def _json_queries(path: Path, content: str) -> tuple[list[str], list[str]]:
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        raise QCGError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})") from exc
    if not isinstance(data, (dict, list)):
        raise QCGError(f"{path}: a .json queries file holds a list of queries or an object of them")
    ids, texts = [], []
    for key, record in data.items() if isinstance(data, dict) else enumerate(data):
        if isinstance(record, dict):
            text, qid = record.get("query") or record.get("question"), record.get("query_id", key)
        else:
            text, qid = record, key
        if not isinstance(text, str) or not text.strip():
            raise QCGError(f"{path}: query {key}: needs a non-empty 'query' (or 'question') string")
        ids.append(str(qid))
        texts.append(text.strip())
    return ids, texts


def load_query_embeddings(path: str | Path) -> np.ndarray:
    try:
        embeddings = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise QCGError(f"cannot read query embeddings {path}: {exc}") from exc
    if not isinstance(embeddings, np.ndarray):  # np.load reads an .npz archive too
        raise QCGError(f"{path} is an .npz archive, not one array; save the (B, d) embeddings with np.save")
    if embeddings.dtype.kind not in "fiu":
        raise QCGError(f"query embeddings must be real numbers, {path} holds {embeddings.dtype}")
    if embeddings.size == 0:  # as an empty queries file: no query is an error, not an empty output
        raise QCGError(f"no queries in {path} (an array of shape {embeddings.shape})")
    return embeddings


def describe(
    index: QCGIndex,
    ids: list[str],
    texts: list[str] | None,
    result: RetrievalResult,
    config: RetrievalConfig,
    queries: np.ndarray | None = None,
) -> list[dict]:
    """One JSON-ready record per query; a trace when ``queries`` (their embeddings) is given."""
    doc_ids = index.chunks.column("doc_id").to_pylist()
    traces = trace_queries(index, queries, result, config.hops) if queries is not None else None
    records = []
    for b, query_id in enumerate(ids):
        chunks = [
            {"chunk_id": int(c), "doc_id": doc_ids[c], "score": round(float(s), 6)}
            for c, s in zip(result.chunk_ids[b], result.scores[b])
            if c >= 0
        ]
        record: dict = {"query_id": query_id, **({"query": texts[b]} if texts else {}), "chunks": chunks}
        if traces is not None:
            record["trace"] = traces[b]
        records.append(record)
    return records


def trec_rankings(index: QCGIndex, result: RetrievalResult, chunks: bool) -> list[Ranking]:
    """Each query's ranking for a TREC run: its chunks (docno DOC_ID#CHUNK_INDEX), or their documents."""
    doc_ids = index.chunks.column("doc_id").to_pylist()
    positions = index.chunks.column("chunk_index").to_pylist()
    rankings = []
    for row, scores in zip(result.chunk_ids, result.scores):
        ranked = [(int(c), float(s)) for c, s in zip(row, scores) if c >= 0]
        if chunks:
            rankings.append([(chunk_docno(doc_ids[c], positions[c]), s) for c, s in ranked])
        else:
            rankings.append(document_ranking([doc_ids[c] for c, _ in ranked], [s for _, s in ranked]))
    return rankings


def add_answers(records: list[dict], texts: list[str], index: QCGIndex, llm, config: AnswerConfig) -> None:
    """``qcg answer``: each record gets the LLM's answer from its chunks (or the request's error)."""
    chunk_ids = [[c["chunk_id"] for c in record["chunks"]] for record in records]
    for record, completion in zip(records, answer_from_chunks(llm, texts, chunk_ids, index.chunk_texts(), config)):
        record["answer"] = completion.text.strip() if not completion.error else None
        if completion.error:
            record["error"] = completion.error
