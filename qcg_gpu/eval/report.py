"""What ``qcg eval`` writes: results.jsonl, summary.md / summary.csv laid out like the paper's Table 1,
comparisons.csv, one CSV + PNG per sweep, TREC run files (qcg_gpu/eval/runfiles.py), and report.html,
the page a person opens in a browser (:func:`write_html`)."""

from __future__ import annotations

import base64
import csv
import gzip
import html
import json
import math
import os
from pathlib import Path

from ..errors import QCGError
from ..log import counted, logger
from ..retrieval import QCGIndex
from . import significance
from .harness import ANSWER_METRICS, Evaluation, metric_names, summarize
from .metrics import metric_base
from .runfiles import document_ranking, write_qrels, write_run

METRIC_TITLES = {
    "judge": "LLM-as-judge accuracy (%)",
    "em": "Exact match (%)",
    "f1": "Token F1 (%)",
    "R": "Evidence recall",
    "RR": "Reciprocal rank of the first evidence document (x100)",
    "nDCG": "nDCG, binary evidence gains (x100)",
    "AP": "Average precision (x100)",
    "Success": "Any evidence document retrieved (%)",
    "AllEvidence": "All evidence documents retrieved (%)",
}


def metric_title(name: str) -> str:
    return METRIC_TITLES[metric_base(name)] + (f", {name}" if "@" in name else "")


def _pct(value: float | None) -> str:
    return "–" if value is None or math.isnan(value) else f"{100 * value:.2f}"


def _metric_tables(rows: list[dict], types: list[str]):
    """Per metric: its title and each method's cells (method, overall, each type), as summary.md and
    report.html show them."""
    for metric in metric_names(rows):
        names = [metric, *(f"{metric}_{t}" for t in types)]
        yield metric_title(metric), [[row["method"], *(_pct(row.get(n)) for n in names)] for row in rows]


def _difference_tables(differences: list[dict], metrics: list[str], types: list[str]):
    """Per metric: its title and, per method, the comparison row of each cell (overall, each type; None
    where none applies)."""
    by_key = {(r["method"], r["metric"]): r for r in differences}
    methods = list(dict.fromkeys(r["method"] for r in differences))
    for metric in metrics:
        names = [metric, *(f"{metric}_{t}" for t in types)]
        yield metric_title(metric), [(method, [by_key.get((method, n)) for n in names]) for method in methods]


def _markdown_table(title: str, header: list[str], cells: list[list[str]]) -> str:
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def markdown_tables(rows: list[dict], types: list[str]) -> str:
    header = ["method", "overall", *types]
    return "\n\n".join(_markdown_table(f"### {title}", header, cells) for title, cells in _metric_tables(rows, types))


def comparison_tables(rows: list[dict], metrics: list[str], types: list[str]) -> str:
    """summary.md's differences from the baseline: per metric, each method's mean difference overall and per
    question type with its 95% interval, * where significant after Holm's adjustment."""
    header = ["method", "overall", *types]
    return "\n\n".join(
        _markdown_table(f"#### {title}", header, [[method, *map(_delta, found)] for method, found in table])
        for title, table in _difference_tables(rows, metrics, types)
    )


def _delta(row: dict | None) -> str:
    if row is None or math.isnan(row["delta"]):
        return "–"
    mark = "*" if row["p_adjusted"] < significance.ALPHA else ""
    return f"{100 * row['delta']:+.2f} [{100 * row['ci_low']:+.2f}, {100 * row['ci_high']:+.2f}]{mark}"


def write_report(
    evaluation: Evaluation,
    out: str | Path,
    header: dict,
    problems: list[str],
    baseline: str | None = None,
    index: QCGIndex | None = None,
) -> list[Path]:
    """results.jsonl, summary.md, summary.csv, comparisons.csv (every method against ``baseline``, when it
    ran), sweep_<name>.csv/.png, the TREC files (:func:`write_runs`), and with the ``index`` run.json,
    traces.jsonl and report.html (:func:`write_html`) in ``out``; returns the paths."""
    from .plots import plot_sweep

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_an_earlier_run(out)
    written = [out / "results.jsonl", out / "summary.md", out / "summary.csv"]
    with open(written[0], "w", encoding="utf-8") as fh:
        for record in evaluation.records:
            fh.write(json.dumps(_without_nan(record), ensure_ascii=False) + "\n")
    rows = summarize(evaluation.records, evaluation.types)
    _write_csv(written[2], rows)
    metrics = metric_names(evaluation.records)
    differences = []
    if baseline is not None and len(rows) > 1 and any(r["method"] == baseline for r in evaluation.records):
        differences = significance.comparisons(evaluation.records, baseline, metrics, evaluation.types)
    if differences:
        written.append(out / "comparisons.csv")
        _write_csv(written[-1], differences)
    first = [r for r in evaluation.records if r["method"] == rows[0]["method"]] if rows else []
    counts = {t: sum(1 for r in first if r["type"] == t) for t in evaluation.types}
    md = [
        "# Evaluation",
        "",
        *[f"- {key}: {value}" for key, value in header.items()],
        f"- questions by type: {counts}",
        f"- retrieval metrics over the {rows[0]['with_evidence'] if rows else 0} of {len(first)} questions "
        "that name evidence documents (answer metrics over all)",
        "",
        markdown_tables(rows, evaluation.types),
    ]
    if baseline is not None and not differences and len(rows) > 1:
        md += ["", f"No comparisons: the baseline {baseline} was not evaluated (--baseline names another)."]
    if differences:
        md += [
            "",
            f"### Differences from {baseline} (points)",
            "",
            f"Per question, over the questions both scored: the mean difference and its 95% paired bootstrap "
            f"interval; * = significant at {significance.ALPHA:g} after Holm's adjustment over all "
            f"{len(differences)} comparisons of this run (a randomization test; comparisons.csv has every p).",
            "",
            comparison_tables(differences, metrics, evaluation.types),
        ]
    faults = {
        what: sum(1 for r in evaluation.records if r.get(key))
        for key, what in (
            ("judge_unparsed", "judge replies without a verdict"),
            ("judge_error", "failed judge requests"),
            ("error", "failed answer requests"),
        )
    }
    if any(faults.values()):
        md += ["", "Counted incorrect: " + ", ".join(f"{what}: {n}" for what, n in faults.items()) + "."]
    for name, sweep_rows in evaluation.sweeps.items():
        _write_csv(out / f"sweep_{name}.csv", sweep_rows)
        plot_sweep(name, sweep_rows, out / f"sweep_{name}.png")
        written += [out / f"sweep_{name}.csv", out / f"sweep_{name}.png"]
        md += ["", f"### Sweep: {name}", "", _selected_on_dev(sweep_rows), "", f"![{name}](sweep_{name}.png)"]
    if problems:
        md += ["", "### Data problems found and handled", "", *[f"- {p}" for p in problems]]
    written[1].write_text("\n".join(md) + "\n", encoding="utf-8")
    written += write_runs(evaluation, out)
    if index is not None:
        run = {"format": RUN_FORMAT, "header": header, "types": evaluation.types, "baseline": baseline}
        run |= {"problems": problems, "index": str(Path(index.path).resolve()), "sweeps": list(evaluation.sweeps)}
        (out / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n", encoding="utf-8")
        with open(out / "traces.jsonl", "w", encoding="utf-8") as fh:
            for qid, trace in evaluation.traces.items():
                fh.write(json.dumps({"qid": qid, **trace}, ensure_ascii=False) + "\n")
        written += [out / "run.json", out / "traces.jsonl", write_html(out, index)]
    return written


def _selected_on_dev(rows: list[dict]) -> str:
    """How many settings a sweep tried, and its best by the first metric, flagged as picked on these questions."""
    metric = next(k for k in rows[0] if k.partition("@")[2].isdigit() or k in ANSWER_METRICS)
    best = max(rows, key=lambda row: row[metric])
    setting = ", ".join(f"{k} = {v}" for k, v in best.items() if k in ("hops", "knn_k", "alpha", "gamma", "n"))
    interval = f"[{_pct(best[f'{metric}_ci_low'])}, {_pct(best[f'{metric}_ci_high'])}]"
    return (
        f"{len(rows)} settings tried; the best by {metric}, {setting}: {_pct(best[metric])} {interval}, selected on "
        "these questions: the best of many on a small split is partly luck, so confirm it once on questions it was "
        "not picked on (benchmarks/lihuaworld/run.sh confirm)."
    )


# what write_report writes into a folder: all of it goes before a new report is written there, so that no
# sweep, method run file or run.json of an earlier evaluation stays beside this one's results
REPORT_FILES = (
    "results.jsonl",
    "summary.md",
    "summary.csv",
    "comparisons.csv",
    "sweep_*.csv",
    "sweep_*.png",
    "qrels.*.txt",
    "runs/*.run",
    "run.json",
    "traces.jsonl",
    "report.html",
)


def _remove_an_earlier_run(out: Path) -> None:
    earlier = [path for pattern in REPORT_FILES for path in out.glob(pattern)]
    if earlier:
        logger.info(f"replacing the earlier evaluation in {out} ({len(earlier)} files)")
    for path in earlier:
        path.unlink()


def write_runs(evaluation: Evaluation, out: Path) -> list[Path]:
    """``runs/METHOD.documents.run`` and ``runs/METHOD.chunks.run`` for every method, with
    ``qrels.documents.txt`` and ``qrels.chunks.txt`` (questions with evidence only) beside them:
    ``ir_measures qrels.documents.txt runs/qcg.documents.run R@5 nDCG@5`` scores a method."""
    records = evaluation.records
    evidence = {r["qid"]: r["evidence"] for r in records if r["evidence"]}
    chunk_evidence = {
        qid: sorted(c for doc in docs for c in evaluation.chunks_of.get(doc, ())) for qid, docs in evidence.items()
    }
    written = [
        write_qrels(out / "qrels.documents.txt", evidence),
        write_qrels(out / "qrels.chunks.txt", chunk_evidence),
    ]
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method]
        name = method.replace("/", "_")
        documents = {r["qid"]: document_ranking(r["docs"], r["scores"]) for r in mine}
        chunks = {r["qid"]: list(zip(r["chunks"], r["scores"])) for r in mine}
        written.append(write_run(out / "runs" / f"{name}.documents.run", documents, method))
        written.append(write_run(out / "runs" / f"{name}.chunks.run", chunks, method))
    return written


def _without_nan(record: dict) -> dict:
    """NaN (a metric that does not apply) as JSON null."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


# --- report.html: one self-contained page (inline CSS and JS, data gzip-compressed) -------------------

RUN_FORMAT = 1  # run.json's layout: report.html is rebuilt (qcg report) only from runs that wrote one
PAGE = Path(__file__).with_name("report_page.html")


def write_html(run_dir: str | Path, index: QCGIndex | None = None) -> Path:
    """report.html of the ``qcg eval`` output in ``run_dir``: the run's settings, metric tables with their
    paired intervals, sweep plots, and every question with each method's chunks and QCG's trace. Chunk
    texts come from ``index`` (default: the one run.json names). Written whole, then renamed into place."""
    run_dir = Path(run_dir)
    run, records, traces = _read_run(run_dir)
    if index is None:
        index = _index_of(run_dir, run)
    types, baseline = run["types"], run.get("baseline")
    rows = summarize(records, types)
    metrics = metric_names(records)
    differences = _read_comparisons(run_dir)
    static = [
        _settings_html(run, records, rows),
        "<h2>Metrics</h2>",
        _tables_html(rows, types),
    ]
    if differences:
        static += [
            f"<h2>Differences from {html.escape(baseline or '')} (points)</h2>",
            f"<p class='note'>Per question, over the questions both scored: the mean difference and its 95% paired "
            f"bootstrap interval; <span class='sig'>bold</span> = significant at {significance.ALPHA:g} after "
            f"Holm's adjustment over all {len(differences)} comparisons (comparisons.csv has every p).</p>",
            _differences_html(differences, metrics, types),
        ]
    static += [_sweeps_html(run_dir, run["sweeps"])]
    data = _page_data(records, traces, index, run.get("header", {}).get("retrieval", {}), baseline)
    untraced = [q["qid"] for q in data["questions"] if "qcg" in q["runs"] and q["qid"] not in traces]
    if untraced:
        logger.warning(
            f"no QCG trace in traces.jsonl: {counted(len(untraced), 'question')} (their view says so): {untraced[:5]}"
        )
    title = f"qcg eval: {run.get('header', {}).get('dataset', run_dir.name)}"
    return _write_page(run_dir / "report.html", title, "\n".join(static), data)


def write_query_page(path: str | Path, records: list[dict], traces: list[dict], index: QCGIndex, top_k: int) -> Path:
    """``qcg query --trace --html``: the question view of report.html for a handful of queries, no gold."""
    questions = [
        {
            "qid": r["query_id"],
            "type": "query",
            "question": r.get("query", r["query_id"]),
            "gold": None,
            "evidence": [],
            "runs": {"qcg": _ranking(r["chunks"])},
        }
        for r in records
    ]
    by_id = {q["qid"]: trace for q, trace in zip(questions, traces)}
    shown = {"methods": ["qcg"], "types": ["query"], "main": "qcg", "baseline": None, "hitMetric": None, "k": top_k}
    data = _data(questions, by_id, index, shown)
    return _write_page(Path(path), "qcg query: traces", "", data)


def _ranking(chunks: list[dict]) -> dict:
    return {"chunks": [c["chunk_id"] for c in chunks], "scores": [c["score"] for c in chunks]}


def _read_run(run_dir: Path) -> tuple[dict, list[dict], dict[str, dict]]:
    """run.json, results.jsonl and traces.jsonl of a run folder, each refused in one line when unusable."""
    results = run_dir / "results.jsonl"
    if not results.is_file():
        raise QCGError(f"{run_dir}: no results.jsonl (is it a qcg eval --out folder?)")
    if not (run_dir / "run.json").is_file():
        raise QCGError(f"{run_dir}: no run.json: written by a qcg eval older than report.html; run qcg eval again")
    try:
        run = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise QCGError(f"{run_dir}/run.json: not JSON ({exc.msg}): a truncated file?") from None
    if not isinstance(run, dict) or run.get("format") != RUN_FORMAT:
        found = run.get("format") if isinstance(run, dict) else None
        raise QCGError(f"{run_dir}/run.json: format {found!r}, this qcg reads {RUN_FORMAT}")
    _require(run, ("types", "sweeps"), f"{run_dir}/run.json")
    records = _jsonl(results, RECORD_KEYS)
    if not records:
        raise QCGError(f"{results}: no records")
    traces_file = run_dir / "traces.jsonl"
    traces = {t.pop("qid"): t for t in _jsonl(traces_file, ("qid",))} if traces_file.is_file() else {}
    return run, records, traces


RECORD_KEYS = ("qid", "type", "method", "evidence", "chunk_ids", "chunks", "docs", "scores")  # what the page reads


def _require(record: dict, keys: tuple[str, ...], where: str) -> None:
    """A file edited by hand, or by another program, that lacks what qcg eval writes: one line, not a KeyError."""
    missing = [key for key in keys if key not in record]
    if missing:
        raise QCGError(f"{where}: no {', '.join(missing)}, which qcg eval writes: an edited file?")


def _read_comparisons(run_dir: Path) -> list[dict]:
    """comparisons.csv as :func:`write_report` wrote it (none: no baseline was compared), read rather
    than computed again: its randomization tests take seconds (4 s for 426 questions x 8 methods)."""
    path = run_dir / "comparisons.csv"
    if not path.is_file():
        return []
    names = ("method", "baseline", "metric")
    with open(path, newline="", encoding="utf-8") as fh:
        try:
            return [{k: v if k in names else float(v) for k, v in row.items()} for row in csv.DictReader(fh)]
        except (TypeError, ValueError) as exc:  # a cut or edited file
            raise QCGError(f"{path}: not the table qcg eval writes ({exc}): a truncated file?") from None


def _jsonl(path: Path, keys: tuple[str, ...]) -> list[dict]:
    """The records of a JSONL file, each an object holding ``keys``."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise QCGError(f"{path}:{number}: not a JSON record ({exc.msg}): a truncated file?") from None
                if not isinstance(record, dict):
                    raise QCGError(f"{path}:{number}: not a JSON object: an edited file?")
                _require(record, keys, f"{path}:{number}")
                records.append(record)
    return records


def _index_of(run_dir: Path, run: dict) -> QCGIndex:
    path = str(run.get("index"))
    try:
        return QCGIndex.load(path, nodes=False)
    except (QCGError, OSError, TypeError) as exc:
        raise QCGError(f"{run_dir}: the run's index {path} cannot be read ({exc}); pass --index PATH") from None


def _page_data(records: list[dict], traces: dict, index: QCGIndex, retrieval: dict, baseline: str | None) -> dict:
    methods = list(dict.fromkeys(r["method"] for r in records))
    hit_metric = next((m for m in metric_names(records) if metric_base(m) == "Success"), None)
    questions: dict[str, dict] = {}
    for r in records:
        q = questions.setdefault(
            r["qid"],
            {key: r.get(key) for key in ("qid", "type", "question", "gold", "evidence")},
        )
        run = {"chunks": r["chunk_ids"], "scores": r["scores"], "hit": r.get(hit_metric) if hit_metric else None}
        if r["evidence"] == []:
            run["hit"] = None  # nothing to hit: a question without evidence
        if "answer" in r:
            run["answer"] = r["answer"]
        q.setdefault("runs", {})[r["method"]] = run
    top_k = int(retrieval.get("top_k") or max((len(r["chunk_ids"]) for r in records), default=5))
    main = "qcg" if "qcg" in methods else methods[0]
    types = list(dict.fromkeys(q["type"] for q in questions.values()))
    shown = {"methods": methods, "types": types, "main": main, "baseline": baseline, "hitMetric": hit_metric}
    return _data(list(questions.values()), traces, index, {**shown, "k": top_k})


def _data(questions: list[dict], traces: dict, index: QCGIndex, shown: dict) -> dict:
    """The page's data: ``shown`` (methods, types, main, baseline, hitMetric, k) with the questions, their
    runs and traces, and the text of every chunk they name."""
    wanted = {c for q in questions for run in q["runs"].values() for c in run["chunks"]}
    for trace in traces.values():
        wanted |= {c["chunk"] for c in trace["chunks"][: shown["k"]]} | {n["chunk"] for n in trace["nodes"].values()}
    doc_ids, texts = index.chunks.column("doc_id").to_pylist(), index.chunks.column("text")
    chunks = {c: {"doc": doc_ids[c], "text": texts[c].as_py()} for c in sorted(wanted) if 0 <= c < len(doc_ids)}
    graded = shown["hitMetric"] is not None
    return {**shown, "graded": graded, "questions": questions, "chunks": chunks, "traces": traces}


def _write_page(path: Path, title: str, static: str, data: dict) -> Path:
    packed = base64.b64encode(gzip.compress(json.dumps(data, ensure_ascii=False).encode(), mtime=0)).decode()
    page = PAGE.read_text(encoding="utf-8").replace("<!--TITLE-->", html.escape(title))
    page = page.replace("<!--STATIC-->", static).replace("<!--DATA-->", packed)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, path)  # a reader never sees half a page
    return path


def _settings_html(run: dict, records: list[dict], rows: list[dict]) -> str:
    header = run.get("header", {})
    values = {k: json.dumps(v) if isinstance(v, dict) else str(v) for k, v in header.items()}
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in values.items())
    first = [r for r in records if r["method"] == rows[0]["method"]]
    note = (
        f"retrieval metrics over the {rows[0]['with_evidence']} of {len(first)} questions that name evidence "
        "documents (answer metrics over all)"
    )
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in run.get("problems", []))
    return f"<h2>Run</h2><table class='settings'>{cells}</table><p class='note'>{note}</p>" + (
        f"<h3>Data problems found and handled</h3><ul>{problems}</ul>" if problems else ""
    )


def _method_table(title: str, types: list[str], rows, cell) -> str:
    """One HTML table of a row per method (``rows``: (method, values)), each value drawn by ``cell``."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["method", "overall", *types])
    body = "".join(
        f"<tr><td>{html.escape(method)}</td>" + "".join(cell(v) for v in values) + "</tr>" for method, values in rows
    )
    return f"<h3>{html.escape(title)}</h3><table><tr>{head}</tr>{body}</table>"


def _tables_html(rows: list[dict], types: list[str]) -> str:
    return "\n".join(
        _method_table(title, types, [(method, values) for method, *values in cells], "<td class='num'>{}</td>".format)
        for title, cells in _metric_tables(rows, types)
    )


def _differences_html(differences: list[dict], metrics: list[str], types: list[str]) -> str:
    return "\n".join(
        _method_table(title, types, table, _difference_cell)
        for title, table in _difference_tables(differences, metrics, types)
    )


def _difference_cell(row: dict | None) -> str:
    """One difference, marked negative and significant (after Holm's adjustment) for the page's styles."""
    marks = "num"
    if row is not None and not math.isnan(row["delta"]):
        marks += " neg" if row["delta"] < 0 else ""
        marks += " sig" if row["p_adjusted"] < significance.ALPHA else ""
    return f"<td class='{marks}'>{html.escape(_delta(row))}</td>"


def _sweeps_html(run_dir: Path, names: list[str]) -> str:
    parts = []
    for name in names:
        png = run_dir / f"sweep_{name}.png"
        if png.is_file():
            source = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
            parts.append(f"<h3>Sweep: {html.escape(name)}</h3><img alt='sweep {html.escape(name)}' src='{source}'>")
    return ("<h2>Sweeps</h2>" + "".join(parts)) if parts else ""
