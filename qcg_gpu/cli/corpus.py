"""``qcg corpus``: write a benchmark's corpus as a file ``qcg index`` reads."""

from __future__ import annotations

import sys


def add_parser(commands) -> None:
    corpus = commands.add_parser(
        "corpus",
        help="convert a benchmark's corpus into a file qcg index reads",
        description="Write MultiHop-RAG's corpus.json as JSONL ({doc_id, text}) for qcg index.",
    )
    corpus.add_argument(
        "--dataset",
        required=True,
        choices=["multihop-rag"],
        help="(LiHuaWorld's docs/, a BEIR corpus.jsonl and a HippoRAG NAME_corpus.json are indexed as they are)",
    )
    corpus.add_argument("--data", required=True, help="directory holding corpus.json, or the file")
    corpus.add_argument("--out", required=True, help="JSONL file to write")
    corpus.set_defaults(run=run)


def run(args) -> int:
    from ..config.utils import check_output_file
    from ..eval.datasets import write_multihop_corpus

    check_output_file(args.out)
    written, skipped = write_multihop_corpus(args.data, args.out)
    print(f"wrote {written} articles to {args.out}")
    if skipped:
        more = f"; {len(skipped) - 5} more" if len(skipped) > 5 else ""
        print(f"left out {len(skipped)} articles: {'; '.join(skipped[:5])}{more}", file=sys.stderr)
    return 0
