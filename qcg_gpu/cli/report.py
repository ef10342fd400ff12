"""``qcg report EVAL_DIR``: report.html of a ``qcg eval`` output folder, made again (qcg eval writes one
with every run): the page to open in a browser, from the run's own files and its index's chunk texts."""

from __future__ import annotations


def add_parser(commands) -> None:
    report = commands.add_parser(
        "report",
        help="rebuild report.html of a qcg eval folder",
        description="Write EVAL_DIR/report.html: the run's settings, metric tables with their intervals, sweep "
        "plots, and every question with each method's chunks and QCG's trace, in one self-contained page.",
    )
    report.add_argument("eval_dir", metavar="EVAL_DIR", help="a folder qcg eval wrote (its --out)")
    report.add_argument("--index", help="the run's index, for chunk texts (default: the path run.json records)")
    report.set_defaults(run=run)


def run(args) -> int:
    from ..eval.report import write_html
    from ..retrieval import QCGIndex

    index = QCGIndex.load(args.index, nodes=False) if args.index else None
    print(write_html(args.eval_dir, index))
    return 0
