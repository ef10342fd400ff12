"""TREC run and qrels files, so trec_eval, ir_measures and ranx read our rankings directly.

* run:   ``qid Q0 docno rank score tag``, best first;
* qrels: ``qid 0 docno 1`` for each relevant docno.

Two levels. Documents: a document ranks where its best chunk ranks, with that chunk's score
(the ranking our evidence metrics score). Chunks: docno ``DOC_ID#CHUNK_INDEX`` (stable across
index versions, unlike chunk ids), and a chunk is relevant when its document is evidence.
Whitespace inside an id would split a line, so it is written percent-encoded (``%20``).
Tools order a run by score and break ties their own way; ours are broken by lower chunk id.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

Ranking = list[tuple[str, float]]  # (docno, score), best first

_WHITESPACE = re.compile(r"\s")


def trec_id(text: str) -> str:
    return _WHITESPACE.sub(lambda m: quote(m.group()), text) if text else "-"


def chunk_docno(doc_id: str, chunk_index: int) -> str:
    return f"{doc_id}#{chunk_index}"


def document_ranking(doc_ids: Sequence[str], scores: Sequence[float]) -> Ranking:
    """Chunks ranked best first -> their documents, each at its best chunk's rank and score."""
    best: dict[str, float] = {}
    for doc_id, score in zip(doc_ids, scores):
        best.setdefault(doc_id, float(score))
    return list(best.items())


def run_lines(qid: str, ranking: Ranking, tag: str) -> Iterable[str]:
    for rank, (docno, score) in enumerate(ranking, 1):
        yield f"{trec_id(qid)} Q0 {trec_id(docno)} {rank} {score:.9g} {trec_id(tag)}\n"


def write_run(path: str | Path, rankings: dict[str, Ranking], tag: str) -> Path:
    """One run file: ``rankings`` maps query id -> ranking."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for qid, ranking in rankings.items():
            fh.writelines(run_lines(qid, ranking, tag))
    return path


def write_qrels(path: str | Path, relevant: Mapping[str, Iterable[str]]) -> Path:
    """Binary qrels: ``relevant`` maps query id -> relevant docnos (queries without any are left out)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for qid, docnos in relevant.items():
            fh.writelines(f"{trec_id(qid)} 0 {trec_id(d)} 1\n" for d in dict.fromkeys(docnos))
    return path
