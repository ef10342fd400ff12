"""``qcg query`` (retrieve the top-K chunks of a batch of queries) and ``qcg answer`` (then answer
each with an LLM); one JSON line per query, or (query) a TREC run file."""

from __future__ import annotations

import json

from ..config import AnswerConfig
from ..config.utils import check_output_file
from ..errors import QCGError
from ..eval.runfiles import run_lines
from ..log import logger
from .options import (
    NO_VERIFY_HELP,
    RETRIEVAL_PREFIX,
    add_llm_options,
    add_options,
    add_output_options,
    add_ray_options,
    add_retrieval_options,
    answering_llm,
    ray_cluster,
    ray_config,
    resolve,
    retrieval_config,
)


def add_parser(commands) -> None:
    query = commands.add_parser(
        "query",
        help="retrieve the top-K chunks for a batch of queries",
        description="Retrieve chunks for queries; one JSON line per query.",
    )
    _add_query_arguments(query)
    query.add_argument(
        "--format",
        default="jsonl",
        choices=("jsonl", "trec", "trec-chunks"),
        help="jsonl: one JSON line per query; trec: a TREC run of documents (each at its best chunk's rank and "
        "score); trec-chunks: a TREC run of chunks, docno DOC_ID#CHUNK_INDEX (default: jsonl)",
    )
    query.set_defaults(run=run, answers=False)

    answer = commands.add_parser(
        "answer",
        help="retrieve, then answer each query with an LLM",
        description="Retrieve chunks and answer each query with an LLM; one JSON line per query.",
    )
    _add_query_arguments(answer)
    add_options(answer, AnswerConfig(), "answer options")
    add_llm_options(answer)
    answer.set_defaults(run=run, answers=True, format="jsonl")


def _add_query_arguments(parser) -> None:
    from ..retrieval import METHODS

    parser.add_argument("index", help="index directory made by qcg index")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--query", help="one query")
    source.add_argument("--queries", help="a .txt file (one query per line) or .jsonl file ({query_id?, query})")
    source.add_argument("--embeddings", help="a .npy file of query embeddings (B, d): bring your own encoder")
    parser.add_argument(
        "--method",
        default="qcg",
        choices=METHODS,
        help="QCG retrieval, or a naive-RAG baseline on the same index (default: qcg)",
    )
    parser.add_argument("--trace", action="store_true", help="add each query's seeds, expanded nodes and chunk scores")
    parser.add_argument(
        "--html",
        metavar="OUT.html",
        help="also a page to open in a browser, each query's chunks and its path from the question through the "
        "seeds and hops (QCG's traces: the JSON lines carry them only with --trace)",
    )
    parser.add_argument("--out", help="write JSON lines here instead of stdout")
    parser.add_argument(
        "--embed-device", default=None, help="torch device of the query embedder (default: cuda when present)"
    )
    parser.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    add_output_options(parser)
    add_retrieval_options(parser, "the paper's retrieval settings for a dataset (explicit options still win)")
    add_ray_options(parser)


def run(args) -> int:
    import numpy as np

    from ..index_format import read_manifest
    from ..retrieval import QCGIndex, check_queries, search
    from ..retrieval.retriever import ray_mode
    from . import query_io

    config = retrieval_config(args)
    if ray_config(args).ray and not args.answers and args.method != "qcg":
        raise QCGError(f"--ray runs QCG retrieval and answering; --method {args.method} retrieves in this process")
    if args.format != "jsonl" and args.trace:
        raise QCGError(f"--trace needs --format jsonl (a {args.format} run has no room for it)")
    traced = "--trace" if args.trace else "--html" if args.html else None  # what needs QCG's traces
    if traced and args.method != "qcg":
        raise QCGError(f"{traced} follows QCG's seeds and hops; --method {args.method} ranks chunks without them")
    qcg_only = [f"--{name}" for name in ("gamma", "n", "hops") if getattr(args, RETRIEVAL_PREFIX + name) is not None]
    if qcg_only and args.method != "qcg":  # a script may pass one set of options to every method: said, not refused
        logger.warning(
            f"{', '.join(qcg_only)} ignored: QCG's settings; --method {args.method} ranks chunks by their own "
            "similarity (only --top-k applies)"
        )
    check_output_file(args.html, "--html")
    if args.answers and args.embeddings:
        raise QCGError("qcg answer needs query texts (--query or --queries), not --embeddings")
    check_output_file(args.out)
    answer_config = resolve(AnswerConfig(), args).validate() if args.answers else None  # before any retrieval
    ray = ray_config(args)
    # on the shards of a sharded index, the workers hold the nodes and this process none of them
    on_shards = ray.ray and args.method == "qcg" and ray_mode(ray.ray_mode, read_manifest(args.index)) == "shards"
    if on_shards and traced:
        raise QCGError(
            f"{traced} walks the graph in this process; with --ray on a sharded index, pass --ray-mode queries"
        )
    # the queries before the index and the LLM load: a bad one is refused in a second, not after them
    if args.embeddings:
        vectors = query_io.load_query_embeddings(args.embeddings)
        ids, texts = [str(i) for i in range(len(np.atleast_2d(vectors)))], None
    else:
        ids, texts = query_io.read_queries(args.query, args.queries)
    index = QCGIndex.load(args.index, verify=not args.no_verify, nodes=not on_shards)
    cluster = ray_cluster(args)
    llm = answering_llm(args, cluster) if args.answers else None  # fail fast, before any retrieval work
    embedder = None
    if texts is not None:
        embedder = index.embedder(args.embed_device)
        vectors = embedder.encode(texts)
    vectors = check_queries(vectors, index.dim)
    if args.method != "qcg" and embedder is None:  # the baselines embed chunk texts with the index's embedder
        embedder = index.embedder(args.embed_device)
    result = search(index, vectors, config, args.method, embedder, cluster if args.method == "qcg" else None)
    if args.method == "qcg":
        _say_which_found_no_seed(result, config)
    records = query_io.describe(index, ids, texts, result, config, vectors if traced else None)
    if answer_config:
        query_io.add_answers(records, texts or [], index, llm, answer_config)
    if args.html:
        from ..eval.report import write_query_page
        from ..retrieval.trace import readable_traces

        traces = readable_traces(index, [record["trace"] for record in records])
        write_query_page(args.html, records, traces, index, config.top_k)
        if not args.trace:  # drawn, not asked for in the results
            records = [{k: v for k, v in record.items() if k != "trace"} for record in records]
    if args.format == "jsonl":
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in records]
    else:
        rankings = query_io.trec_rankings(index, result, args.format == "trec-chunks")
        lines = [
            line
            for record, ranking in zip(records, rankings)
            for line in run_lines(record["query_id"], ranking, args.method)
        ]
    query_io.write_output(args.out, lines)
    failed = [record["error"] for record in records if "error" in record]
    if failed:  # as a build whose LLM requests failed: the work is kept, and the exit code says it
        logger.warning(f"{len(failed)} of {len(records)} answers failed ({failed[0]}); each record holds its error")
        return 3
    return 0


def _say_which_found_no_seed(result, config) -> None:
    """A query with no node at or above gamma has no seeds, so no chunks (METHOD.md, retrieval step 2):
    an empty result is the method, and the line says which threshold made it."""
    unseeded = int((result.n_selected == 0).sum())
    if unseeded:
        logger.warning(
            f"{unseeded} of {len(result.n_selected)} queries found no node with sim + 1 >= gamma = {config.gamma:g} "
            f"(cosine >= {config.gamma - 1:g}), so no chunks; a lower --gamma admits more seeds"
        )
