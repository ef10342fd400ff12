"""``qcg eval``: retrieval (and, with an LLM, answer) metrics of methods, ablations and sweeps on a
benchmark's questions over an index of its corpus."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import PRESETS, AnswerConfig, EvalConfig, RetrievalConfig
from ..errors import QCGError
from ..eval.datasets import DATASETS
from ..llm.cache import ReplyStore, answer_cache
from .options import (
    NO_VERIFY_HELP,
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
    evaluate = commands.add_parser(
        "eval",
        help="score methods, ablations and sweeps on a benchmark",
        description="Evaluate retrieval (and answers, with an LLM) on a benchmark's questions over an index of its "
        "corpus.",
    )
    evaluate.add_argument("--dataset", required=True, choices=DATASETS, help="question format of --data")
    evaluate.add_argument(
        "--data",
        required=True,
        help="lihuaworld: its directory (docs/ + questions JSON) or the questions file; "
        "multihop-rag: directory with corpus.json and MultiHopRAG.json; jsonl: the questions file",
    )
    evaluate.add_argument("--index", required=True, help="index of the dataset's corpus, made by qcg index")
    evaluate.add_argument("--out", required=True, help="directory for results.jsonl, summary.md/.csv and sweep plots")
    evaluate.add_argument(
        "--compare-index",
        action="append",
        metavar="LABEL=PATH",
        help="another index of the same corpus (other chunking, embedder, LLM); its rows are labelled "
        "METHOD@LABEL (repeatable)",
    )
    evaluate.add_argument("--judge-model", help="LLM-as-judge model on the same backend (default: the answering LLM)")
    evaluate.add_argument(
        "--embed-device", default=None, help="torch device of the question embedder (default: cuda when present)"
    )
    add_output_options(evaluate)
    evaluate.add_argument("--no-verify", action="store_true", help=NO_VERIFY_HELP)
    add_options(evaluate, EvalConfig(), "evaluation options")
    add_retrieval_options(evaluate, "the paper's retrieval settings (default: the dataset's own, when it has one)")
    add_options(evaluate, AnswerConfig(), "answer options")
    add_llm_options(evaluate)
    add_ray_options(evaluate)
    evaluate.set_defaults(run=run)


@dataclass
class EvalRun:
    """What one ``qcg eval`` compares: the settings, the main index and the compared ones, the questions."""

    config: EvalConfig
    index: Any  # QCGIndex (imported when the command runs)
    compared: dict[str, Any]
    evalset: Any  # EvalSet
    retrieval: RetrievalConfig
    answer_config: AnswerConfig
    cluster: Any = None
    llms: dict[str, Any] = field(default_factory=dict)  # "llm" and "judge" when answers are scored


def run(args) -> int:
    from ..eval.datasets import load_dataset
    from ..eval.harness import check_evidence

    config = resolve(EvalConfig(), args).validate()  # refuse unknown names before loading anything
    _refuse_answer_options_without_answers(args, config)
    compare_paths = dict(_labelled(args.compare_index))
    _check_baseline(config, args.baseline is not None, compare_paths)
    _check_output_dir(args.out)
    if args.preset is None and args.dataset in PRESETS:
        args.preset = args.dataset
    retrieval = retrieval_config(args)
    answer_config = resolve(AnswerConfig(), args).validate()
    evalset = load_dataset(args.dataset, args.data)
    evalset.questions = config.select(evalset.questions)
    index = _load_index(args, config, args.index)
    evalset.problems += check_evidence(index, evalset, config.allow_missing_evidence)
    compared = {label: _load_index(args, config, path) for label, path in compare_paths.items()}
    for label, other in compared.items():
        evalset.problems += [f"[{label}] {p}" for p in check_evidence(other, evalset, config.allow_missing_evidence)]
    job = EvalRun(config, index, compared, evalset, retrieval, answer_config, ray_cluster(args))
    if not config.answers:
        return _evaluate(args, job)
    store = ReplyStore(answer_cache(config.answers_cache), config.answers_in, config.answers_out)
    try:
        job.llms["llm"] = answering_llm(args, job.cluster, store=store)
        if config.judge and args.judge_model:
            job.llms["judge"] = answering_llm(args, job.cluster, args.judge_model, store)
        return _evaluate(args, job)
    finally:
        store.close()  # --answers-out holds every reply so far, whatever happened


ANSWER_ONLY_OPTIONS = ("judge", "judge_model", "sweep_answers", "answers_cache", "answers_in", "answers_out")


def _refuse_answer_options_without_answers(args, config: EvalConfig) -> None:
    """--no-answers (or answers = false in --config) beside an option given for the answers: it was ignored
    without a word, so a run meant to be judged, or to store its answers, came back without them."""
    given = [name for name in ANSWER_ONLY_OPTIONS if getattr(args, name) not in (None, False)]
    if given and not config.answers:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise QCGError(f"{flags}: only for answers, which --no-answers turns off; drop one or the other")


def _load_index(args, config: EvalConfig, path: str):
    """The index at ``path``; without its node arrays where --ray retrieves shard by shard (``--ray-mode
    shards``, the default on an index of node shards): the workers hold them. Work that needs every node
    in this process is refused then."""
    from ..index_format import read_manifest
    from ..retrieval import QCGIndex
    from ..retrieval.retriever import ray_mode

    ray = ray_config(args)
    shards = ray.ray and ray_mode(ray.ray_mode, read_manifest(path)) == "shards"
    if shards and config.whole_index_work():
        raise QCGError(
            f"{', '.join(config.whole_index_work())} derive an index from every node in this process, which --ray "
            "over node shards does not hold; run them without --ray or with --ray-mode queries"
        )
    return QCGIndex.load(path, verify=not args.no_verify, nodes=not shards)


def _evaluate(args, job: EvalRun) -> int:
    """Every method on the index (and the compared ones), then the report."""
    from ..eval.harness import Answering, Harness
    from ..eval.report import write_report

    config, index, llm, judge_llm = job.config, job.index, job.llms.get("llm"), job.llms.get("judge")
    answering = Answering(llm, job.answer_config, judge_llm) if llm else None

    def harness(ix):
        embedder = ix.embedder(args.embed_device)
        return Harness(ix, job.evalset, embedder, job.retrieval, answering, cluster=job.cluster)

    evaluation = harness(index).run(config)
    for label, other in job.compared.items():  # the same methods on another index of the corpus; sweeps on the main one
        evaluation.add(harness(other).run(dataclasses.replace(config, sweeps="")), label)
    header = {
        "dataset": f"{args.dataset} ({args.data})",
        "index": args.index,
        **{f"index @{label}": other_path for label, other_path in _labelled(args.compare_index)},
        "index LLM": index.manifest["models"]["llm"],
        "embedder": index.manifest["models"]["embedder"],
        "answering LLM": llm.model_name if llm else "none (retrieval metrics only)",
        "judge LLM": (judge_llm or llm).model_name if llm and config.judge else "none",
        **({"LLM replies": _replies_note(config, llm, judge_llm)} if llm else {}),
        "retrieval": dataclasses.asdict(job.retrieval) | {"knn_k": index.manifest["settings"]["graph"]["knn_k"]},
    }
    paths = write_report(evaluation, args.out, header, job.evalset.problems, config.baseline, index)
    print(paths[1].read_text())
    return 0


def _check_output_dir(out: str) -> None:
    """Refuse an OUT that could not hold the report, before any work (answers are cached either way)."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QCGError(f"--out {out}: cannot make that folder ({exc.strerror})") from exc
    if not os.access(path, os.W_OK):
        raise QCGError(f"--out {out}: not writable")


def _replies_note(config, *llms) -> str:
    reused = sum(llm.reused for llm in llms if llm)
    asked = sum(llm.asked for llm in llms if llm)
    return f"{reused} reused from {answer_cache(config.answers_cache)}, {asked} asked of the LLM"


def _check_baseline(config: EvalConfig, given: bool, compare_paths: dict[str, str]) -> None:
    """Refuse, before any work, a --baseline that would not be evaluated (the report said only "No
    comparisons" at the end of the run). The default, naive, may be left out: then nothing is compared."""
    label = config.baseline.partition("@")[2]
    if label and label not in compare_paths:
        labels = ", ".join(compare_paths) or "none given"
        raise QCGError(f"--baseline {config.baseline}: no --compare-index is labelled {label!r} (labels: {labels})")
    config.check_baseline(named=given)  # validate() checked it only where it differs from the default


def _labelled(specs: list[str] | None) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for spec in specs or []:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise QCGError(f"--compare-index takes LABEL=PATH, got {spec!r}")
        if label in dict(pairs):  # its methods' rows would be one index's or the other's
            raise QCGError(f"--compare-index: the label {label!r} is given twice; give each index its own")
        pairs.append((label, path))
    return pairs
