"""Paired statistics of qcg eval (qcg_gpu/eval/significance.py): hand-computable cases, then a real run's
per-question results checked against scipy's own bootstrap and permutation test."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from qcg_gpu.config import EvalConfig, IndexConfig
from qcg_gpu.eval import significance
from qcg_gpu.eval.datasets import load_dataset
from qcg_gpu.eval.harness import Harness
from qcg_gpu.eval.report import write_report
from qcg_gpu.retrieval import QCGIndex, RetrievalConfig

from .conftest import REPO

DEV = REPO.parent / "shared" / "data" / "lihuaworld"


def test_the_randomization_test_enumerates_every_sign_pattern_of_a_few_questions():
    rng = np.random.default_rng(0)
    # [2, 1]: mean differences 1.5, 0.5, -0.5, -1.5 over the four patterns; two reach |1.5|
    assert significance.sign_flip_p(np.array([2.0, 1.0]), rng) == 0.5
    # five equal wins: only all-plus and all-minus reach a mean of 1 -> 2 / 32
    assert significance.sign_flip_p(np.ones(5), rng) == pytest.approx(2 / 32)
    # no difference at all: every pattern ties the observed 0
    assert significance.sign_flip_p(np.zeros(4), rng) == 1.0


def test_the_bootstrap_of_constant_differences_is_a_point():
    rng = np.random.default_rng(0)
    assert significance.paired_bootstrap_ci(np.full(30, 0.25), rng) == (0.25, 0.25)


def test_holm_adjusts_step_down():
    # sorted 0.01, 0.03, 0.04: x3 = 0.03, x2 = 0.06, x1 = 0.04 -> raised to 0.06 (monotone); NaN left out
    assert significance.holm([0.04, 0.01, float("nan"), 0.03]) == pytest.approx(
        [0.06, 0.03, float("nan"), 0.06], nan_ok=True
    )
    assert significance.holm([0.5, 0.9]) == [1.0, 1.0]  # 0.9 x 1 is raised to the 1.0 before it


def test_comparisons_pair_questions_by_id_per_type():
    records = [
        {"method": m, "qid": q, "type": t, "R@5": v}
        for m, values in (("naive", [0.0, 1.0, 0.5, None]), ("qcg", [1.0, 1.0, 0.0, 1.0]))
        for q, t, v in zip("abcd", ["single", "single", "multi", "multi"], values)
    ]
    rows = {r["metric"]: r for r in significance.comparisons(records, "naive", ["R@5"], ["single", "multi"])}
    assert rows["R@5"]["questions"] == 3  # d has no baseline value
    assert rows["R@5"]["delta"] == pytest.approx((1.0 + 0.0 - 0.5) / 3)
    assert (rows["R@5"]["wins"], rows["R@5"]["losses"], rows["R@5"]["ties"]) == (1, 1, 1)
    assert rows["R@5_single"]["delta"] == 0.5 and rows["R@5_multi"]["delta"] == -0.5
    assert significance.comparisons(records, "naive", ["R@5"], []) == significance.comparisons(
        records, "naive", ["R@5"], []
    )  # seeded: a rerun gives the same numbers


@pytest.fixture(scope="module")
def dev_run(tmp_path_factory, embedder):
    """A real retrieval-only run: the dev split's first 40 single-hop questions, over a sentence-node index
    (no LLM) of the documents they cite, naive RAG against QCG on sentence nodes."""
    if not DEV.is_dir():
        pytest.skip("the LiHuaWorld dev split is not beside the checkout (../shared/data/lihuaworld)")
    root = tmp_path_factory.mktemp("dev_run")
    evalset = load_dataset("lihuaworld", DEV)
    evalset.questions = [q for q in evalset.questions if q.type == "single"][:40]
    docs = root / "docs"
    for doc in {d for q in evalset.questions for d in q.evidence}:
        (docs / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(DEV / "docs" / f"{doc}.txt", docs / f"{doc}.txt")
    config = IndexConfig()
    config.nodes.nodes, config.nodes.device = "sentence", "cpu"
    from qcg_gpu import build_index

    build_index(docs, root / "index", config, embedder=embedder)
    harness = Harness(QCGIndex.load(root / "index"), evalset, embedder, RetrievalConfig(gamma=1.3, n=10))
    evaluation = harness.run(EvalConfig(methods="naive,qcg", answers=False))
    write_report(evaluation, root / "report", {}, [], baseline="naive")
    return evaluation, root / "report"


def test_a_real_runs_statistics_match_scipy(dev_run):
    stats = pytest.importorskip("scipy.stats")
    evaluation, _ = dev_run
    by_method: dict[str, dict] = {}
    for r in evaluation.records:
        by_method.setdefault(r["method"], {})[r["qid"]] = r
    for metric in ("R@5", "RR@5"):
        qids = [q for q in by_method["qcg"] if q in by_method["naive"]]
        diffs = np.array([by_method["qcg"][q][metric] - by_method["naive"][q][metric] for q in qids])
        assert len(diffs) == 40 and np.any(diffs != 0)
        ours = significance.compare(np.c_[diffs, np.zeros_like(diffs)], np.random.default_rng(1))
        theirs_p = stats.permutation_test(
            (diffs,), np.mean, permutation_type="samples", n_resamples=50_000, alternative="two-sided", random_state=2
        ).pvalue
        theirs_ci = stats.bootstrap(
            (diffs,), np.mean, method="percentile", n_resamples=50_000, random_state=3
        ).confidence_interval
        assert ours["delta"] == pytest.approx(diffs.mean())
        assert ours["p_value"] == pytest.approx(theirs_p, abs=0.02), metric  # both Monte Carlo: a few 0.001 apart
        assert ours["ci_low"] == pytest.approx(theirs_ci.low, abs=0.01), metric
        assert ours["ci_high"] == pytest.approx(theirs_ci.high, abs=0.01), metric


def test_a_report_carries_the_comparisons(dev_run):
    import csv

    evaluation, report = dev_run
    rows = list(csv.DictReader(open(report / "comparisons.csv")))
    assert {r["method"] for r in rows} == {"qcg"} and {r["baseline"] for r in rows} == {"naive"}
    assert {"R@5", "R@5_single", "RR@5", "nDCG@5"} <= {r["metric"] for r in rows}
    row = next(r for r in rows if r["metric"] == "R@5")
    assert float(row["ci_low"]) <= float(row["delta"]) <= float(row["ci_high"]) and int(row["questions"]) == 40
    assert float(row["p_value"]) <= float(row["p_adjusted"]) <= 1
    summary = (report / "summary.md").read_text()
    assert "### Differences from naive (points)" in summary
    assert f"{100 * float(row['delta']):+.2f} [{100 * float(row['ci_low']):+.2f}" in summary
    again = write_report(evaluation, report.parent / "again", {}, [], baseline="naive")
    assert (report.parent / "again" / "comparisons.csv").read_text() == (report / "comparisons.csv").read_text()
    assert again[3].name == "comparisons.csv"
    write_report(evaluation, report.parent / "other", {}, [], baseline="d2q")  # not evaluated in this run
    assert not (report.parent / "other" / "comparisons.csv").exists()
    assert "No comparisons: the baseline d2q was not evaluated" in (report.parent / "other" / "summary.md").read_text()


def test_a_report_written_over_another_leaves_none_of_its_files(dev_run, tmp_path):
    """A rerun into the same --out kept the earlier run's comparisons, method run files and sweeps beside
    the new results (and qcg report drew them together)."""
    from qcg_gpu.eval.report import REPORT_FILES

    evaluation, report = dev_run
    out = tmp_path / "report"
    first = write_report(evaluation, out, {}, [], baseline="naive", index=QCGIndex.load(report.parent / "index"))
    # every file a report writes is one that the next report removes
    assert all(any(p.relative_to(out).match(pattern) for pattern in REPORT_FILES) for p in first), first
    assert {"run.json", "report.html"} <= {p.name for p in first}
    (out / "sweep_hops.csv").write_text("hops,R@5\n")  # as a run with --sweeps hops left it
    (out / "notes.txt").write_text("mine")
    naive_only = dataclasses.replace(evaluation, records=[r for r in evaluation.records if r["method"] == "naive"])
    written = write_report(naive_only, out, {}, [], baseline="naive")
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert left == sorted([str(p.relative_to(out)) for p in written] + ["notes.txt"]), left
    assert "runs/qcg.documents.run" not in left and "comparisons.csv" not in left


def test_a_baseline_that_is_not_evaluated_is_refused():
    from qcg_gpu.errors import QCGError

    with pytest.raises(QCGError, match="--baseline d2q is not among the methods"):
        EvalConfig(methods="naive,qcg", baseline="d2q").validate()
    EvalConfig(methods="naive,qcg", baseline="naive@c512").validate()  # a --compare-index row of naive
    EvalConfig(methods="qcg,d2q").validate()  # the default baseline, not run: no comparisons, no refusal


@pytest.mark.parametrize(
    "options, message",
    [
        (["--methods", "qcg", "--baseline", "naive"], "--baseline naive is not among the methods evaluated (qcg)"),
        (["--baseline", "qcg@h2"], "--baseline qcg@h2: no --compare-index is labelled 'h2' (labels: none given)"),
        (
            ["--baseline", "qcg@a", "--compare-index", "b=IDX"],
            "--baseline qcg@a: no --compare-index is labelled 'a' (labels: b)",
        ),
    ],
)
def test_qcg_eval_refuses_a_baseline_it_would_not_evaluate_before_any_work(tmp_path, cli, options, message):
    """Each ran the whole evaluation, then said "No comparisons" (the default baseline named, not run:
    the same), where the user asked for them."""
    out = tmp_path / "report"
    options = [f"b={tmp_path / 'index'}" if o == "b=IDX" else o for o in options]
    result = cli(
        "eval",
        "--dataset",
        "jsonl",
        "--data",
        tmp_path / "missing.jsonl",
        "--index",
        tmp_path / "index",
        "--out",
        out,
        "--no-answers",
        *options,
    )
    assert result.returncode == 2 and f"qcg: error: {message}" in result.stderr and not out.exists()
