"""Where QCG's seeds land against the evidence: the trace view of METHOD.md's retrieval, over the
dev split, next to naive RAG on the same index.

    python benchmarks/lihuaworld/seed_analysis.py INDEX [--gamma 1.5 --n 10 --hops 1 --top-k 5]

For each question type it prints, as a markdown table:
- no seed: share of questions where no node reaches sim + 1 >= gamma (QCG returns nothing);
- seed in evidence: share of questions with at least one seed from an evidence document;
- seed precision: share of all seeds that come from an evidence document;
- Q* in evidence: the same for the selected nodes (seeds and their expansion);
- chunks scored: chunks with a node in Q* (fewer than K: QCG returns fewer than K chunks);
- evidence reached: recall over every chunk scored, QCG's recall with K unbounded (what is lost
  between it and QCG recall is lost by the ranking, the rest by the selection);
- best seed sim: mean cosine of the best seed;
- top-1 seed's chunk in top K: how often the chunk of the best seed survives the chunk ranking;
- recall@K of QCG and of naive RAG.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from qcg_gpu.config import RetrievalConfig
from qcg_gpu.eval.datasets import NULL_TYPE, load_dataset
from qcg_gpu.eval.metrics import evidence_recall
from qcg_gpu.retrieval import QCGIndex, search, trace_queries

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "lihuaworld"


def analyse(index: QCGIndex, data: Path, config: RetrievalConfig) -> dict[str, dict[str, float]]:
    questions = [q for q in load_dataset("lihuaworld", data).questions if q.type != NULL_TYPE]
    embedder = index.embedder()
    vectors = embedder.encode([q.question for q in questions], "questions")
    qcg = search(index, vectors, config)
    naive = search(index, vectors, config, "naive", embedder)
    chunk_doc = np.array(index.chunks.column("doc_id").to_pylist(), dtype=object)
    node_doc = chunk_doc[index.node_chunk]
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    traces = trace_queries(index, vectors, qcg, config.hops)
    for b, q in enumerate(questions):
        evidence = set(q.evidence)
        seeds = qcg.seed_ids[b][qcg.seed_ids[b] >= 0]
        trace = traces[b]
        selected = np.array([s["node_id"] for s in trace["seeds"]] + trace["expanded"], dtype=np.int64)
        top = [int(c) for c in qcg.chunk_ids[b] if c >= 0]
        row = {
            "no seed": float(len(seeds) == 0),
            "seed in evidence": float(any(node_doc[s] in evidence for s in seeds)),
            "seed precision": float(np.mean([node_doc[s] in evidence for s in seeds])) if len(seeds) else np.nan,
            "Q* in evidence": float(np.mean([node_doc[s] in evidence for s in selected])) if len(selected) else np.nan,
            "chunks scored": float(len(set(index.node_chunk[selected].tolist()))),
            "evidence reached": evidence_recall(sorted(set(node_doc[selected])), q.evidence) if len(selected) else 0.0,
            "best seed sim": float(qcg.seed_sims[b][0]) if len(seeds) else np.nan,
            "top-1 seed's chunk in top K": float(int(index.node_chunk[seeds[0]]) in top) if len(seeds) else np.nan,
            "QCG recall": evidence_recall([chunk_doc[c] for c in top], q.evidence),
            "naive recall": evidence_recall([chunk_doc[c] for c in naive.chunk_ids[b] if c >= 0], q.evidence),
        }
        rows[q.type].append(row)
        rows["overall"].append(row)
    return {kind: {k: float(np.nanmean([r[k] for r in rs])) for k in rs[0]} for kind, rs in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index", type=Path)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--gamma", type=float, default=1.5)
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--hops", type=int, default=1)
    parser.add_argument("--top-k", type=int, default=5)
    args = parser.parse_args()
    config = RetrievalConfig(gamma=args.gamma, n=args.n, hops=args.hops, top_k=args.top_k)
    table = analyse(QCGIndex.load(args.index), args.data, config)
    kinds = ["overall"] + sorted(k for k in table if k != "overall")
    print(f"gamma {config.gamma}, n {config.n}, hops {config.hops}, K {config.top_k}; {args.index}\n")
    print("| | " + " | ".join(kinds) + " |\n|---|" + "---|" * len(kinds))
    for metric in table["overall"]:
        scale = 1 if metric in ("best seed sim", "chunks scored") else 100
        print(f"| {metric} | " + " | ".join(f"{scale * table[k][metric]:.2f}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
