"""Evaluation settings: methods, sweeps, answers and their files."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import QCGError
from .utils import check_at_least, check_fields, check_output_file, comma_names, option

BASELINES = ("naive", "d2q", "d2q-minus")  # naive RAG over chunk embeddings (METHOD.md, "Baselines")
ABLATIONS = ("qcg-qa", "qcg-q", "qcg-a", "qcg-sentence")  # QCG with other node texts (the paper's ablation)
EVAL_METHODS = BASELINES + ("qcg",) + ABLATIONS
SWEEPS: dict[str, list[dict[str, float]]] = {  # name -> the points of the paper's figures
    "hops": [{"hops": h} for h in (0, 1, 2)],
    "knn": [{"knn_k": k} for k in (1, 2, 3, 4, 5)],
    "seeds": [{"gamma": g, "n": n} for g in (1.0, 1.5) for n in (5, 10, 15, 20)],
    "alpha": [{"alpha": a} for a in (0.2, 0.4, 0.6, 0.8, 1.0)],
}
INDEX_PARAMETERS = ("knn_k", "alpha")  # sweep parameters that need a derived index


@dataclass
class EvalConfig:
    methods: str = option(
        "naive,d2q,d2q-minus,qcg",
        "Comma-separated methods: " + ", ".join(EVAL_METHODS) + " (qcg-* are node-text ablations).",
    )
    sweeps: str = option("", "Comma-separated sweeps of QCG settings: " + ", ".join(SWEEPS) + " (seeds = n x gamma).")
    baseline: str = option(
        "naive",
        "Method every other one is compared with, question by question, in comparisons.csv and summary.md: the "
        "mean difference with its 95% paired bootstrap interval and a randomization-test p, Holm-adjusted over the "
        "run (METHOD@LABEL names a --compare-index row).",
    )
    answers: bool = option(
        True, "Answer every question with the LLM and score the answers (exact match, token F1, judge)."
    )
    judge: bool = option(True, "Score answers with the LLM as judge (deterministic decoding, one-word verdict).")
    sweep_answers: bool = option(
        False,
        "Also answer and judge at every sweep point (one LLM pass per point); otherwise sweeps are scored by "
        "retrieval metrics.",
    )
    limit_per_type: int | None = option(
        None, "Evaluate only the first N questions of each type (quick, balanced runs)."
    )
    allow_missing_evidence: bool = option(
        False,
        "Score retrieval even when questions have evidence documents the index does not hold (counted as misses) "
        "or evidence the corpus does not name (left out of retrieval metrics); refused by default, since such a "
        "run scores another question set than the dataset's.",
    )
    answers_cache: str | None = option(
        None,
        "Cache (SQLite file) of answers and judgements, keyed by model, sampling and conversation (default: user "
        "cache dir): a rerun of an interrupted evaluation asks the LLM only what is missing.",
        runtime=True,
    )
    answers_in: str | None = option(
        None,
        "Parquet file of stored answers and judgements (from --answers-out) to add to the cache first: replays an "
        "evaluation made elsewhere; the LLM is loaded only if some reply is missing.",
        runtime=True,
    )
    answers_out: str | None = option(
        None,
        "Write this evaluation's answers and judgements (keyed like the cache) to a Parquet file, rewritten as "
        "they come, to share or commit a long run.",
        runtime=True,
    )

    def validate(self) -> EvalConfig:
        check_fields(self)
        self.method_list(), self.sweep_list()  # unknown names refused
        self.check_baseline(named=self.baseline != EvalConfig.baseline)
        check_at_least(self, 1, "limit_per_type")
        if self.answers_in and not os.path.isfile(self.answers_in):
            raise QCGError(f"stored answers file not found: {self.answers_in}")
        check_output_file(self.answers_out, "--answers-out", folders_made=True)
        return self

    def check_baseline(self, named: bool) -> None:
        """QCGError for a baseline whose method is not evaluated, where it was ``named`` (in a file, an
        argument, on the command line): the default, naive, may be left out, and then nothing is compared."""
        if named and self.baseline.partition("@")[0] not in self.method_list():
            raise QCGError(f"--baseline {self.baseline} is not among the methods evaluated ({self.methods})")

    def method_list(self) -> list[str]:
        return comma_names(self.methods, EVAL_METHODS, "method")

    def sweep_list(self) -> list[str]:
        return comma_names(self.sweeps, SWEEPS, "sweep") if self.sweeps.strip() else []

    def whole_index_work(self) -> list[str]:
        """The methods and sweeps that derive an index from every node in this process (node-text
        ablations, kNN degree and alpha sweeps): what a driver holding no node array cannot run."""
        sweeps = [s for s in self.sweep_list() if any(k in INDEX_PARAMETERS for k in SWEEPS[s][0])]
        return [m for m in self.method_list() if m in ABLATIONS] + [f"--sweeps {s}" for s in sweeps]

    def select(self, questions: list) -> list:
        """The first ``limit_per_type`` questions of each type (all without a limit)."""
        limit = self.validate().limit_per_type
        if limit is None:
            return questions
        taken: dict[str, int] = {}
        chosen = []
        for question in questions:
            if taken.get(question.type, 0) < limit:
                taken[question.type] = taken.get(question.type, 0) + 1
                chosen.append(question)
        return chosen
