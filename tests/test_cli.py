"""The qcg command's structure: subcommands, the older spellings of qcg index, and which errors
become one-line messages (no model is loaded here)."""

import pytest

from qcg_gpu.capabilities import MissingDependency
from qcg_gpu.cli import build_parser, check, index, main


@pytest.mark.parametrize(
    "old, new",
    [
        (["index", "docs", "out", "--m", "4"], ["index", "build", "docs", "out", "--m", "4"]),
        (["index", "--add", "docs", "idx", "--quiet"], ["index", "add", "docs", "idx", "--quiet"]),
        (["index", "idx", "--remove", "a", "b", "--quiet"], ["index", "remove", "idx", "a", "b", "--quiet"]),
        (["index", "--quiet", "idx", "--remove", "a"], ["index", "remove", "--quiet", "idx", "a"]),
        (["index", "docs", "idx", "--dry-run", "--add"], ["index", "plan", "docs", "idx", "--add"]),
        (["index", "build", "docs", "out"], ["index", "build", "docs", "out"]),
        (["query", "idx", "--query", "q"], ["query", "idx", "--query", "q"]),
    ],
)
def test_older_index_spellings_become_subcommands(old, new):
    assert index.current_spelling(old) == new
    parsed = build_parser().parse_args(new)
    assert parsed.run is {
        "build": index.run_build,
        "add": index.run_add,
        "remove": index.run_remove,
        "plan": index.run_plan,
    }.get(getattr(parsed, "action", None), parsed.run)


def test_removed_documents_are_parsed_after_the_index():
    args = build_parser().parse_args(index.current_spelling(["index", "idx", "--remove", "a", "b"]))
    assert (args.index, args.doc_ids) == ("idx", ["a", "b"])


def test_only_qcg_errors_become_one_line_messages(monkeypatch, capsys):
    def missing(args):
        raise MissingDependency("faiss is needed here but not importable; install it with: pip install faiss-cpu")

    monkeypatch.setattr(check, "run", missing)
    assert main(["check", "idx"]) == 2
    assert (
        capsys.readouterr().err
        == "qcg: error: faiss is needed here but not importable; install it with: pip install faiss-cpu\n"
    )

    def bug(args):
        raise ImportError("cannot import name 'x' from 'qcg_gpu.y'")  # a real bug, not a missing dependency

    monkeypatch.setattr(check, "run", bug)
    with pytest.raises(ImportError, match="cannot import name"):
        main(["check", "idx"])


def test_quiet_silences_stage_messages_and_progress_bars(capsys):
    from qcg_gpu.log import progress_bar, quiet
    from qcg_gpu.stages import IndexSummary, stage

    try:
        quiet(True)
        with stage(IndexSummary(out=None), "embed"):
            list(progress_bar(range(3), desc="texts"))
        assert capsys.readouterr().err == ""
        quiet(False)
        with stage(IndexSummary(out=None), "embed"):
            list(progress_bar(range(3), desc="texts"))
        err = capsys.readouterr().err
        assert "[qcg] embed ..." in err and "texts" in err
    finally:
        quiet(False)
