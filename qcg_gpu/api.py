"""The Python facade for people who start from text, in the spirit of HippoRAG's batch API:

    from qcg_gpu import QCGRag
    rag = QCGRag("INDEX")                                  # the index's own embedder; the paper's settings
    solutions = rag.retrieve(["Who is Adam?"], top_k=5)    # ranked chunks per question
    solutions, scores = rag.rag_qa(questions, gold_docs=..., gold_answers=...)  # + answers and metrics

Everything runs batched, through the same calls as the CLI (``retrieval.search``,
``answer.answer_from_chunks``); the LLM loads on the first ``rag_qa``. :func:`index_settings` and
:func:`retrieval_settings` give settings in the order the command line takes them (``config.layered``):
a config file's tables, then a preset or a stored generation's settings, then the arguments given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from .config import PRESETS, AnswerConfig, AnsweringLLMConfig, GenerationConfig, IndexConfig, RetrievalConfig, layered
from .config.files import read_config_file
from .errors import QCGError
from .llm.backends import LLMBackend
from .llm.cache import stored_settings


@dataclass
class QuerySolution:
    """One question's retrieval (and answer): chunks best first, with their documents and scores."""

    question: str
    chunk_ids: list[int]
    doc_ids: list[str]
    texts: list[str]
    scores: list[float]
    top_k: int  # the K it was retrieved with (the cutoff of its metrics)
    answer: str | None = None
    error: str | None = None  # the answering request's error, if it failed
    gold_docs: list[str] = field(default_factory=list)
    gold_answers: list[str] = field(default_factory=list)


class QCGRag:
    """An index opened for batch retrieval and question answering.

    ``method``: qcg or a baseline (naive, d2q, d2q-minus) on the same index. ``retrieval``:
    QCG's settings (default: the paper's LiHuaWorld ones). ``llm``: an LLM backend, or the settings to
    build one, an AnsweringLLMConfig (a GenerationConfig too) (default: the bundled model, in-process vLLM)."""

    def __init__(
        self,
        index: str | Path,
        retrieval: RetrievalConfig | None = None,
        method: str = "qcg",
        llm: LLMBackend | AnsweringLLMConfig | GenerationConfig | None = None,
        answer: AnswerConfig | None = None,
        embed_device: str | None = None,
    ):
        from .retrieval import METHODS, QCGIndex

        if method not in METHODS:
            raise QCGError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
        _check_type("retrieval", retrieval, RetrievalConfig)
        _check_type("answer", answer, AnswerConfig)
        _check_type("llm", llm, LLMBackend, AnsweringLLMConfig, GenerationConfig)
        self.index = QCGIndex.load(index)
        self.retrieval = (retrieval or RetrievalConfig()).validate()
        self.method, self.answer_config = method, (answer or AnswerConfig()).validate()
        self.embedder = self.index.embedder(embed_device)
        self._llm = llm

    def retrieve(self, questions: list[str], top_k: int | None = None) -> list[QuerySolution]:
        """Each question's top-K chunks (``top_k`` overrides the retrieval config's)."""
        from .eval.datasets import check_query_texts
        from .retrieval import check_queries, search

        if isinstance(questions, str) or not isinstance(questions, Iterable):
            raise QCGError(f"questions must be a list of non-empty strings, got {type(questions).__name__}")
        questions = list(questions)
        if not all(isinstance(q, str) and q.strip() for q in questions):
            raise QCGError("questions must be a list of non-empty strings")
        if not questions:
            return []
        check_query_texts([str(i) for i in range(len(questions))], questions, "questions")
        config = self.retrieval if top_k is None else replace(self.retrieval, top_k=top_k).validate()
        vectors = check_queries(self.embedder.encode(questions, "questions"), self.index.dim)
        result = search(self.index, vectors, config, self.method, self.embedder)
        doc_ids, texts = self.index.chunks.column("doc_id").to_pylist(), self.index.chunk_texts()
        solutions = []
        for question, row, scores in zip(questions, result.chunk_ids, result.scores):
            ranked = [(int(c), float(s)) for c, s in zip(row, scores) if c >= 0]
            solutions.append(
                QuerySolution(
                    question,
                    [c for c, _ in ranked],
                    [doc_ids[c] for c, _ in ranked],
                    [texts[c] for c, _ in ranked],
                    [s for _, s in ranked],
                    config.top_k,
                )
            )
        return solutions

    def rag_qa(
        self,
        questions: list[str] | list[QuerySolution],
        gold_docs: list[list[str]] | None = None,
        gold_answers: list[list[str]] | list[str] | None = None,
    ) -> tuple[list[QuerySolution], dict[str, float]]:
        """Retrieve (unless given solutions), answer every question in one batched LLM call, and,
        where gold documents or answers are given, score: the retrieval metrics (``R@K``, ...) over
        the questions with gold documents, exact match and token F1 against the best gold answer."""
        from .answer import answer_from_chunks
        from .eval.metrics import best_over, exact_match, retrieval_scores, token_f1

        solutions: list[QuerySolution]
        if questions and all(isinstance(q, QuerySolution) for q in questions):
            solutions = [q for q in questions if isinstance(q, QuerySolution)]
        else:
            solutions = self.retrieve(cast(list[str], list(questions)))  # it refuses anything but strings
        for name, gold in (("gold_docs", gold_docs), ("gold_answers", gold_answers)):
            if gold is not None and len(gold) != len(solutions):
                raise QCGError(f"{name} has {len(gold)} entries for {len(solutions)} questions")
        if not solutions:
            return [], {}
        completions = answer_from_chunks(
            self.llm,
            [s.question for s in solutions],
            [s.chunk_ids for s in solutions],
            self.index.chunk_texts(),
            self.answer_config,
        )
        scores: dict[str, list[float]] = {}
        for i, (solution, completion) in enumerate(zip(solutions, completions)):
            solution.answer = None if completion.error else completion.text.strip()
            solution.error = completion.error
            if gold_docs is not None and gold_docs[i]:
                solution.gold_docs = list(gold_docs[i])
                for name, value in retrieval_scores(solution.doc_ids, solution.gold_docs, solution.top_k).items():
                    scores.setdefault(name, []).append(value)
            if gold_answers is not None and gold_answers[i]:  # a question without a gold answer is not scored
                golds = gold_answers[i]
                solution.gold_answers = [golds] if isinstance(golds, str) else list(golds)
                answer = solution.answer or ""
                scores.setdefault("em", []).append(best_over(exact_match, answer, solution.gold_answers))
                scores.setdefault("f1", []).append(best_over(token_f1, answer, solution.gold_answers))
        return solutions, {name: sum(values) / len(values) for name, values in scores.items()}

    @property
    def llm(self) -> LLMBackend:
        """The answering LLM, loaded on first use."""
        if not isinstance(self._llm, LLMBackend):
            from .llm.backends import make_backend

            config = self._llm or AnsweringLLMConfig()
            self._llm = make_backend(config.as_generation() if isinstance(config, AnsweringLLMConfig) else config)
        return self._llm


def _check_type(name: str, value, *kinds: type) -> None:
    """QCGError for an argument of another type (a model name given as ``llm``, a dict as ``retrieval``):
    it failed later with an AttributeError."""
    if value is not None and not isinstance(value, kinds):
        raise QCGError(f"{name} must be {' or '.join(k.__name__ for k in kinds)} (or None), got {value!r}")


def index_settings(config_file=None, replies_in=None, **given: dict) -> IndexConfig:
    """An index build's settings as ``qcg index build`` takes them (:func:`layered`): defaults < the
    ``config_file``'s tables < the settings the stored generation ``replies_in`` (or the file's or
    ``given``'s ``replies_in``) was made with < ``given``, a dict per section, e.g.
    ``index_settings("qcg.toml", generation={"m": 6})``."""
    unknown = set(given) - set(IndexConfig.SECTIONS)
    if unknown:
        raise QCGError(f"unknown settings section(s) {sorted(unknown)} (choose from {', '.join(IndexConfig.SECTIONS)})")
    from_file = read_config_file(config_file) if config_file else {}
    if replies_in is not None:
        given = {**given, "generation": {**given.get("generation", {}), "replies_in": str(replies_in)}}

    def settings(stored: dict) -> IndexConfig:
        config = IndexConfig()
        for name in IndexConfig.SECTIONS:
            layered(getattr(config, name), from_file.get(name), stored.get(name), given.get(name))
        return config

    config = settings({})
    path = config.generation.replies_in
    if path and os.path.isfile(path):  # a missing file is refused by validate()
        config = settings(IndexConfig.stored_values(stored_settings(path) or {}))
    return config


def retrieval_settings(config_file=None, preset: str | None = None, **given) -> RetrievalConfig:
    """Retrieval settings as ``qcg query`` takes them (:func:`layered`): defaults < the ``config_file``'s
    [retrieval] table < the ``preset`` (a dataset's: lihuaworld, multihop-rag) < ``given``, e.g.
    ``retrieval_settings(preset="multihop-rag", top_k=8)``."""
    if preset is not None and preset not in PRESETS:
        raise QCGError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    from_file = read_config_file(config_file).get("retrieval") if config_file else None
    return layered(RetrievalConfig(), from_file, PRESETS.get(preset or ""), given).validate()
