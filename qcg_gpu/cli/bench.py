"""``qcg bench``: this machine's speed at each step (``qcg_gpu/eval/bench.py``), as tables and JSON."""

from __future__ import annotations

import json

from ..config import GenerationConfig, GraphConfig, IndexConfig, RetrievalConfig
from ..eval.bench import BenchConfig
from ..log import logger
from .options import add_options, resolve


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure retrieval (against faiss+numpy and torch.topk), kNN, embedding and Doc2Query speed here",
        description="Measure this machine: retrieval q/s per backend next to the faiss+numpy and torch.topk routes "
        "on a synthetic index, kNN build (exact and approximate), embedding texts/s, and Doc2Query output tok/s "
        "against the bare vLLM engine. Prints a table per part (and JSON with --json); each row shows on stderr as "
        "it is measured.",
    )
    add_options(bench, BenchConfig(), "bench options")
    add_options(bench, RetrievalConfig(), "retrieval settings", only=("gamma", "n", "hops", "top_k"))
    add_options(bench, GraphConfig(), "kNN settings (knn)", only=("knn_k", "knn_probes"))
    add_options(bench, GenerationConfig(), "Doc2Query settings (doc2query)", only=("model", "m"))
    bench.set_defaults(run=run)


def run(args) -> int:
    from ..config.utils import check_output_file
    from ..eval.bench import format_table, write_json
    from ..eval.bench import run as measure

    config = resolve(BenchConfig(), args).validate()
    check_output_file(config.json, "--json")  # before the measurements, which take minutes
    retrieval = resolve(RetrievalConfig(), args)
    settings = IndexConfig()  # the parts measured read [graph] and [generation]: defaults < config file < options
    for section in (settings.graph, settings.generation):  # (--nodes and --device are the bench's own)
        resolve(section, args)
    rows = []
    for row in measure(config, retrieval, settings):
        rows.append(row)
        # each row on stderr as it is measured (measurements take minutes); stdout holds the tables alone
        logger.info(json.dumps({k: v for k, v in row.items() if k != "cpu"}))
    print(format_table(rows))
    if config.json:
        write_json(rows, config.json)
    return 0
