"""An early look at a generation still under way: the documents it covers, and the dev questions
whose evidence lies in them, indexed and scored like run.sh does the whole corpus.

    python benchmarks/lihuaworld/partial_eval.py benchmarks/lihuaworld/replies-NAME-partial.parquet OUT

Writes OUT/docs (links to the covered documents), OUT/questions.jsonl (the dev questions whose
every evidence document is covered, and the Null questions), builds OUT/index from the stored
replies (no LLM) and runs `qcg eval` on it into OUT/retrieval. The corpus is smaller than the
whole one, so recall is higher for every method than on the whole corpus: compare the methods
with each other, not with whole-corpus numbers.

    ... --also benchmarks/lihuaworld/replies-OTHER.parquet

indexes the same documents from another generation too (into OUT/OTHER) and scores QCG on the
same questions: two prompts or models compared side by side on what the newer one covers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from qcg_gpu.config import IndexConfig
from qcg_gpu.eval.datasets import NULL_TYPE, load_dataset
from qcg_gpu.indexing import doc2query
from qcg_gpu.indexing.chunking import chunk_document, load_tokenizer
from qcg_gpu.indexing.documents import SkipLog, read_documents
from qcg_gpu.llm.cache import stored_settings

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "lihuaworld"


def covered_documents(replies: Path, docs: Path) -> tuple[list[str], int]:
    """Doc ids whose every chunk has a stored reply, and the corpus's document count."""
    config = IndexConfig.from_dict(stored_settings(replies) or {})
    stored = set(pq.read_table(replies, columns=["key"]).column("key").to_pylist())
    tokenizer, covered, total = load_tokenizer(config.chunking.tokenizer), [], 0
    for doc in read_documents(docs, SkipLog()):
        total += 1
        chunks = chunk_document(doc.doc_id, doc.pieces(), tokenizer, config.chunking)
        keys = [doc2query.cache_key(c.text, config.generation.model, config.generation) for c in chunks]
        if all(key in stored for key in keys):
            covered.append(doc.doc_id)
    return covered, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--also", type=Path, nargs="*", default=[], help="other generations, scored on the same part")
    args = parser.parse_args()

    covered, total = covered_documents(args.replies, args.data / "docs")
    subset = args.out / "docs"
    subset.mkdir(parents=True, exist_ok=True)
    for doc_id in covered:
        link = subset / f"{doc_id}.txt"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to((args.data / "docs" / f"{doc_id}.txt").resolve())
    questions = [
        q
        for q in load_dataset("lihuaworld", args.data).questions
        if q.type == NULL_TYPE or (q.evidence and set(q.evidence) <= set(covered))
    ]
    with open(args.out / "questions.jsonl", "w") as fh:
        for q in questions:
            fh.write(
                json.dumps(
                    {
                        "query_id": q.qid,
                        "question": q.question,
                        "answer": q.answer,
                        "evidence_doc_ids": q.evidence,
                        "type": q.type,
                    }
                )
                + "\n"
            )
    counts = {t: sum(q.type == t for q in questions) for t in sorted({q.type for q in questions})}
    print(f"{len(covered)} of {total} documents covered; {len(questions)} dev questions: {counts}", flush=True)

    evaluate(
        args.replies, subset, args.out, args.out / "questions.jsonl", "naive,d2q,d2q-minus,qcg,qcg-q,qcg-a,qcg-sentence"
    )
    for other in args.also:
        name = other.stem.removeprefix("replies-")
        evaluate(other, subset, args.out / name, args.out / "questions.jsonl", "naive,qcg")


def evaluate(replies: Path, docs: Path, out: Path, questions: Path, methods: str) -> None:
    """Index ``docs`` from the stored ``replies`` (no LLM) into OUT/index, then score ``methods`` into OUT/retrieval."""
    qcg = [sys.executable, "-m", "qcg_gpu.cli"]
    index = ["index", "build", docs, out / "index", "--overwrite", "--quiet", "--replies-in", replies]
    subprocess.run([*qcg, *index, "--cache", out / "replay-cache.sqlite"], check=True)
    scoring = ["eval", "--dataset", "jsonl", "--data", questions, "--index", out / "index", "--preset", "lihuaworld"]
    options = ["--out", out / "retrieval", "--no-answers", "--quiet", "--methods", methods, "--sweeps", "seeds,alpha"]
    subprocess.run([*qcg, *scoring, *options], check=True)


if __name__ == "__main__":
    main()
