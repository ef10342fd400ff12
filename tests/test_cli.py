"""The qcg command's structure: subcommands, the older spellings of qcg index, and which errors
become one-line messages (no model is loaded here)."""

import json
import re

import numpy as np
import pytest

from qcg_gpu.capabilities import MissingDependency
from qcg_gpu.cli import build_parser, check, index, main
from qcg_gpu.errors import QCGError
from qcg_gpu.models import QWEN_CODER_1_5B, SMOLLM2


@pytest.mark.parametrize(
    "old, new",
    [
        (["index", "docs", "out", "--m", "4"], ["index", "build", "docs", "out", "--m", "4"]),
        (["index", "--add", "docs", "idx", "--quiet"], ["index", "add", "docs", "idx", "--quiet"]),
        (["index", "idx", "--remove", "a", "b", "--quiet"], ["index", "remove", "idx", "a", "b", "--quiet"]),
        (["index", "--quiet", "idx", "--remove", "a"], ["index", "remove", "--quiet", "idx", "a"]),
        (["index", "docs", "idx", "--dry-run", "--add"], ["index", "plan", "docs", "idx", "--add"]),
        (["index", "--retry-failed", "idx", "--quiet"], ["index", "retry", "idx", "--quiet"]),
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
        "retry": index.run_retry,
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
    from qcg_gpu.indexing.stages import IndexSummary, stage
    from qcg_gpu.log import progress_bar, quiet

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


CONFIG_TOML = """
[generation]
m = 7
model = "qwen2.5-coder-1.5b"
[nodes]
alpha = 0.6
[retrieval]
gamma = 1.2
top_k = 8
[eval]
methods = "naive,qcg"
"""


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_a_config_file_overrides_defaults_and_the_command_line_wins(tmp_path, suffix):
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import index_config
    from qcg_gpu.cli.options import resolve, retrieval_config
    from qcg_gpu.config import EvalConfig

    path = tmp_path / f"qcg{suffix}"
    if suffix == ".toml":
        path.write_text(CONFIG_TOML, encoding="utf-8-sig")  # with a byte-order mark, as Windows editors save it
    else:
        import tomllib
        import yaml

        path.write_text(yaml.safe_dump(tomllib.loads(CONFIG_TOML)))
    args = parse_arguments(["--config", str(path), "index", "build", "docs", "out", "--m", "9"])
    config = index_config(args)
    assert config.generation.m == 9 and config.generation.model == "qwen2.5-coder-1.5b" and config.nodes.alpha == 0.6
    assert config.nodes.nodes == "qa"  # not in the file, not given: the default
    args = parse_arguments(["query", "idx", "--query", "x", "--top-k", "3", f"--config={path}"])
    retrieval = retrieval_config(args)
    assert (retrieval.gamma, retrieval.top_k, retrieval.n) == (1.2, 3, 10)
    args = parse_arguments(
        ["eval", "--dataset", "lihuaworld", "--data", "d", "--index", "i", "--out", "o", "--config", str(path)]
    )
    assert resolve(EvalConfig(), args).methods == "naive,qcg"


def test_the_answering_llm_takes_its_own_table_not_the_builds(tmp_path, capsys):
    """[generation] is the build's: its model no longer becomes the one qcg answer and qcg eval answer with
    (issue 37 §5). [answer_llm] sets the answering LLM, below the options given."""
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.options import answering_llm
    from qcg_gpu.config import GenerationConfig
    from qcg_gpu.llm.backends import llm_name
    from qcg_gpu.llm.cache import ReplyStore

    path, store = tmp_path / "qcg.toml", ReplyStore(tmp_path / "answers.sqlite")
    served = 'backend = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
    build = f'[generation]\n{served}model = "the-build-model"\n'

    def answering_model(*given):
        args = parse_arguments(["answer", "idx", "--query", "x", "--config", str(path), *given])
        return answering_llm(args, store=store).model_name  # a CachedLLM: nothing loads

    path.write_text(f'{build}[answer_llm]\n{served}model = "answerer"\n')
    assert answering_model() == "answerer"
    assert answering_model("--model", "typed") == "typed"  # an option given wins
    assert "[answer_llm]" not in capsys.readouterr().err
    path.write_text(build)
    assert answering_model() == llm_name(GenerationConfig())  # the default, not the build's model
    assert "the answering LLM reads [answer_llm]" in capsys.readouterr().err  # said once, for a file written before


def test_the_python_api_takes_settings_in_the_order_the_cli_does(tmp_path):
    """index_settings and retrieval_settings: defaults < config file < preset or stored generation < the
    arguments given, the same settings as the command line's for the same inputs."""
    from qcg_gpu import index_settings, retrieval_settings
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import build_config

    from .conftest import REPO

    path = tmp_path / "qcg.toml"
    path.write_text(
        '[retrieval]\ngamma = 1.2\ntop_k = 8\n\n[generation]\nm = 6\nmodel = "smollm2"\ntemperature = 0.9\n'
    )
    retrieval = retrieval_settings(path)
    assert (retrieval.gamma, retrieval.top_k, retrieval.n) == (1.2, 8, 10)
    retrieval = retrieval_settings(path, preset="multihop-rag", n=12)
    assert (retrieval.gamma, retrieval.top_k, retrieval.n) == (1.0, 5, 12)  # the preset over the file
    stored = REPO / "benchmarks" / "lihuaworld" / "replies-qwen2.5-coder-1.5b.parquet"
    config = index_settings(path, replies_in=stored, generation={"m": 5})
    assert (config.generation.model, config.generation.temperature) == ("qwen2.5-coder-1.5b", 0.3)  # stored > file
    assert config.generation.m == 5 and config.chunking.chunk_tokens == 1200
    argv = ["--config", str(path), "index", "build", "docs", "out", "--replies-in", str(stored), "--m", "5"]
    assert build_config(parse_arguments(argv)) == config
    assert index_settings(path).generation.m == 6
    with pytest.raises(QCGError, match="unknown GenerationConfig setting 'mm'"):
        index_settings(generation={"mm": 1})
    with pytest.raises(QCGError, match="unknown preset 'nope'"):
        retrieval_settings(preset="nope")
    with pytest.raises(QCGError, match=re.escape("--knn (knn) must be one of exact, approximate, got 'approx'")):
        index_settings(graph={"knn": "approx"})  # a value outside the choices is refused, as on the command line


def test_every_section_refuses_a_value_outside_its_choices():
    """Through validate() too, which the Python API calls: IndexConfig(graph=GraphConfig(knn="approx"))
    once built an exact graph without a word."""
    import dataclasses

    from qcg_gpu import build_index
    from qcg_gpu.config import CONFIG_SECTIONS, GraphConfig, IndexConfig

    checked = 0
    for section in CONFIG_SECTIONS.values():
        for f in dataclasses.fields(section):
            if f.metadata.get("choices"):
                with pytest.raises(QCGError, match=re.escape(f"({f.name}) must be one of")):
                    section(**{f.name: "bogus"}).validate()
                checked += 1
    assert checked >= 10
    with pytest.raises(QCGError, match=re.escape("--knn (knn) must be one of exact, approximate, got 'approx'")):
        build_index("no-docs", "no-index", IndexConfig(graph=GraphConfig(knn="approx")))


def test_every_section_refuses_a_value_of_another_type():
    """Through validate(), which the Python API calls: top_k="3" raised Python's TypeError and hops=1.5
    was searched as it stood. numpy's numbers are taken as Python's (settings are written as JSON)."""
    import dataclasses

    from qcg_gpu.config import CONFIG_SECTIONS, AnsweringLLMConfig, RetrievalConfig

    checked = 0
    for section in CONFIG_SECTIONS.values():
        for f in dataclasses.fields(section):
            with pytest.raises(QCGError, match=re.escape(f"({f.name}) must be {f.type}, got [1]")):
                section(**{f.name: [1]}).validate()  # a list fits no setting
            checked += 1
    assert checked >= 60
    for bad, message in (
        (dict(top_k="3"), "--top-k (top_k) must be int, got '3'"),
        (dict(hops=1.5), "--hops (hops) must be int, got 1.5"),
        (dict(n=True), "--n (n) must be int, got True"),
        (dict(gamma="1.5"), "--gamma (gamma) must be float, got '1.5'"),
    ):
        with pytest.raises(QCGError, match=re.escape(message)):
            RetrievalConfig(**bad).validate()
    config = RetrievalConfig(top_k=np.int64(3), gamma=np.float32(1.25), n=7).validate()
    assert (config.top_k, config.gamma, config.n) == (3, 1.25, 7)
    assert type(config.top_k) is int and type(config.gamma) is float
    assert type(AnsweringLLMConfig(max_num_seqs=np.int32(4)).validate().max_num_seqs) is int


def test_a_preset_overrides_the_config_file_and_options_given_override_both(tmp_path):
    """The one order: defaults < config file < --preset < options given (the issue's case: a file
    written with gamma 1.5 no longer undoes --preset multihop-rag's gamma 1.0)."""
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.options import retrieval_config

    path = tmp_path / "qcg.toml"
    path.write_text("[retrieval]\ngamma = 1.5\nn = 12\ntop_k = 7\n")
    query = ["query", "idx", "--query", "x", "--config", str(path)]

    def settings(*extra):
        config = retrieval_config(parse_arguments([*query, *extra]))
        return config.gamma, config.n, config.hops, config.top_k

    assert settings() == (1.5, 12, 1, 7)  # the file over the defaults
    assert settings("--preset", "multihop-rag") == (1.0, 15, 1, 5)  # the preset over the file
    assert settings("--preset", "multihop-rag", "--n", "3") == (1.0, 3, 1, 5)  # an option given over both
    evaluation = ["eval", "--dataset", "multihop-rag", "--data", "d", "--index", "i", "--out", "o"]
    args = parse_arguments([*evaluation, "--config", str(path)])
    args.preset = "multihop-rag"  # what qcg eval does for a dataset with a preset of its own
    assert retrieval_config(args).gamma == 1.0


@pytest.mark.parametrize(
    "command",
    [
        ["index", "build", "docs", "out"],
        ["index", "build", "docs", "out", "--m", "5", "--prompt", "quoted"],
        ["query", "idx", "--query", "x", "--preset", "multihop-rag"],
        ["query", "idx", "--query", "x", "--gamma", "1.1"],
        ["answer", "idx", "--query", "x", "--preset", "lihuaworld", "--model", "qwen2.5-coder-1.5b"],
        ["eval", "--dataset", "jsonl", "--data", "d", "--index", "i", "--out", "o", "--no-answers", "--ray"],
        ["bench", "--parts", "retrieval", "--gamma", "1.0"],
    ],
)
def test_a_file_written_by_init_changes_nothing_by_itself(tmp_path, command):
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.options import SECTION_NAMES, resolve, retrieval_config

    path = tmp_path / "qcg.toml"
    assert main(["init", str(path)]) == 0

    def every_setting(argv):
        args = parse_arguments(argv)
        settings = {name: resolve(cls(), args) for cls, name in SECTION_NAMES.items()}
        if hasattr(args, "preset"):
            settings["retrieval"] = retrieval_config(args)
        return settings

    assert every_setting([*command, "--config", str(path)]) == every_setting(command)


def test_a_stored_generation_overrides_the_config_file(tmp_path):
    """--replies-in restores the settings its replies were made with, over a config file's (and under options
    given on the command line)."""
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import build_config
    from qcg_gpu.config import IndexConfig
    from qcg_gpu.llm.cache import GenerationCache

    made_with = IndexConfig()
    made_with.generation.m, made_with.generation.prompt, made_with.chunking.chunk_tokens = 6, "quoted", 512
    replies = tmp_path / "replies.parquet"
    cache = GenerationCache(tmp_path / "cache.sqlite")
    cache.export_parquet([], replies, made_with.reply_settings())
    cache.close()
    path = tmp_path / "qcg.toml"
    path.write_text('[generation]\nm = 9\nprompt = "basic"\ncache = "my.sqlite"\n[chunking]\nchunk_tokens = 300\n')
    build = ["--config", str(path), "index", "build", "docs", "out", "--replies-in", str(replies)]
    config = build_config(parse_arguments(build))
    assert (config.generation.m, config.generation.prompt, config.chunking.chunk_tokens) == (6, "quoted", 512)
    assert config.generation.cache == "my.sqlite"  # how to run is not recorded: the file's stays
    config = build_config(parse_arguments([*build, "--m", "4"]))
    assert (config.generation.m, config.generation.prompt) == (4, "quoted")


@pytest.mark.parametrize(
    "model,measured",
    [
        ([], SMOLLM2.generation),  # the bundled default
        (["--model", "qwen2.5-coder-1.5b"], QWEN_CODER_1_5B.generation),
        (["--model", "/models/my-llm"], {}),  # a model of the user's: MODEL_DECIDED's
    ],
)
def test_a_packaged_llm_s_own_settings_fill_only_what_no_setting_names(tmp_path, model, measured):
    """defaults < the model's measured settings < config file < stored generation < options given (issue 37 §7)."""
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import build_config
    from qcg_gpu.config import MODEL_DECIDED, IndexConfig
    from qcg_gpu.llm.cache import GenerationCache

    def settled(*argv):
        generation = build_config(parse_arguments(["index", "build", "docs", "out", *model, *argv])).generation
        return {key: getattr(generation.settle(), key) for key in MODEL_DECIDED}

    assert settled() == {**MODEL_DECIDED, **measured}
    path = tmp_path / "qcg.toml"
    path.write_text("[generation]\ncompact_json = false\nmax_pair_tokens = 7\n")
    assert settled("--config", str(path)) == {**MODEL_DECIDED, **measured, "compact_json": False, "max_pair_tokens": 7}
    assert settled("--no-compact-json", "--repetition-penalty", "1.3")["repetition_penalty"] == 1.3
    assert settled("--no-compact-json")["compact_json"] is False and settled("--compact-json")["compact_json"]
    made_with = IndexConfig()  # a generation recorded before compact_json and max_pair_tokens existed
    recorded = {name: values for name, values in made_with.reply_settings().items()}
    for key in ("compact_json", "max_pair_tokens", "model"):
        recorded["generation"].pop(key)
    replies = tmp_path / "replies.parquet"
    cache = GenerationCache(tmp_path / "cache.sqlite")
    cache.export_parquet([], replies, recorded)
    cache.close()
    assert settled("--replies-in", str(replies))["compact_json"] is False  # how its replies were made


def test_the_bundled_llm_s_settings_reach_the_engine_the_key_and_the_manifest(small_index):
    """A default build (the small_index fixture: IndexConfig() and the vllm_backend fixture's GenerationConfig())
    runs SmolLM2's measured settings: compact JSON replies from the real engine, capped at its tokens a pair."""
    import sqlite3

    from qcg_gpu.index_format import read_manifest

    generation = read_manifest(small_index)["settings"]["generation"]
    assert (generation["compact_json"], generation["max_pair_tokens"]) == (True, SMOLLM2.generation["max_pair_tokens"])
    with sqlite3.connect(small_index.parent / "cache.sqlite") as db:
        replies = [json.loads(value) for (value,) in db.execute("SELECT value FROM replies")]
    assert replies and all(r["text"].startswith('{"pairs":[{"') and "\n" not in r["text"] for r in replies)
    assert all(r["output_tokens"] <= 4 * 100 + 32 for r in replies)  # M = 4


def test_a_toml_config_file_reads_on_python_3_10(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: tomli, a dependency there, reads the same file."""
    import sys

    from qcg_gpu.config.files import read_config_file

    path = tmp_path / "qcg.toml"
    path.write_text(CONFIG_TOML)
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` fails as on 3.10
    assert read_config_file(path)["retrieval"] == {"gamma": 1.2, "top_k": 8}


def test_yaml_null_sets_an_optional_option_to_none_and_is_refused_for_others(tmp_path, capsys):
    from qcg_gpu.cli import parse_arguments
    from qcg_gpu.cli.index import index_config

    path = tmp_path / "qcg.yaml"
    path.write_text("generation:\n  model: null\n  max_tokens: null\nnodes:\n  device: null\n")
    config = index_config(parse_arguments(["--config", str(path), "index", "build", "docs", "out"]))
    assert config.generation.model is None and config.generation.max_tokens is None and config.nodes.device is None
    path.write_text("generation:\n  m: null\n")
    assert main(["--config", str(path), "index", "build", "docs", "out"]) == 2
    assert "generation.m = None, expected int" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text,message",
    [
        ("[generation\nm = 1", "config file"),
        ("[generator]\nm = 1", "unknown section [generator]"),
        ("[generation]\nmm = 1", "unknown option generation.mm"),
        ('[generation]\nm = "many"', "generation.m = 'many', expected int"),
        ("[nodes]\nalpha = true", "nodes.alpha = True, expected float"),
        ('[graph]\nknn = "approx"', "graph.knn = 'approx', choose from exact, approximate"),
        ('[retrieval]\nbackend = "gpu"', "retrieval.backend = 'gpu', choose from auto, torch, numpy"),
        ("[generation]\nbatch_chunks = 0", "--batch-chunks (batch_chunks) must be >= 1, got 0"),
        ("[generation]\nconcurrency = 0", "--concurrency (concurrency) must be >= 1, got 0"),
    ],
)
def test_bad_config_files_are_refused_in_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["--config", str(path), "index", "build", "docs", "out"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty", None, "no .txt or .md files under"),
        ("docs.json", '{"doc_id": "a"}', "a .json input must hold a list"),
        ("docs.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_a_bad_input_is_refused_before_a_progress_bar_is_drawn(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.mkdir() if content is None else path.write_text(content)
    assert main(["index", "build", str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "chunk documents" not in err  # an empty bar was drawn first
    assert err.startswith("qcg: error: "), err  # and the chunk stage's "[qcg] chunk ..." line before it


def test_init_writes_every_default(tmp_path, capsys):
    import dataclasses

    from qcg_gpu.config import CONFIG_SECTIONS
    from qcg_gpu.config.files import read_config_file

    path = tmp_path / "qcg.toml"
    assert main(["init", str(path)]) == 0
    written = read_config_file(path)
    for name, section in CONFIG_SECTIONS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(section) if f.default is not None}
        assert written[name] == defaults, name
    assert main(["init", str(path)]) == 2 and "exists (--force overwrites it)" in capsys.readouterr().err
    missing = tmp_path / "no-such-folder" / "qcg.toml"  # was a FileNotFoundError traceback
    assert main(["init", str(missing)]) == 2
    assert f"qcg: error: cannot write {missing}: No such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [[], ["index"], *(["index", a] for a in ("build", "add", "remove", "retry", "plan")), ["query"], ["answer"]]
    + [["eval"], ["report"], ["check"], ["models"], ["corpus"], ["bench"], ["init"]],
)
def test_every_help_page_prints(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0 and "usage: qcg" in capsys.readouterr().out


def test_a_zero_embedding_batch_is_refused_before_any_model_loads(tmp_path, cli):
    result = cli("index", "build", tmp_path, tmp_path / "out", "--nodes", "sentence", "--embed-batch-size", "0")
    assert result.returncode == 2 and "--embed-batch-size (embed_batch_size) must be >= 1, got 0" in result.stderr


@pytest.mark.parametrize(
    "command, option",
    [
        (["corpus", "--dataset", "multihop-rag", "--data", "DATA"], "--out"),
        (["bench", "--parts", "retrieval", "--nodes", "1000", "--batch", "10", "--repeat", "1"], "--json"),
    ],
)
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(tmp_path, cli, command, option):
    """Were tracebacks: qcg corpus's at once, qcg bench's after its measurements."""
    (tmp_path / "corpus.json").write_text(json.dumps([{"title": "T", "body": "B", "url": "u"}]))
    command = [tmp_path if arg == "DATA" else arg for arg in command]
    for out in (tmp_path / "missing" / "out.json", tmp_path):
        result = cli(*command, option, out)
        assert result.returncode == 2 and f"qcg: error: {option} {out}" in result.stderr


@pytest.mark.parametrize("option", ["--replies-out", "--answers-out"])
def test_a_shared_replies_file_that_cannot_be_written_is_refused_before_any_work(tmp_path, cli, option):
    """Was a traceback when the run first wrote it: after generating, for a folder given as --replies-out."""
    (tmp_path / "a-file").write_text("")
    command = ["index", "build", tmp_path, tmp_path / "idx"]
    if option == "--answers-out":
        command = ["eval", "--dataset", "jsonl", "--data", tmp_path, "--index", tmp_path, "--out", tmp_path / "o"]
    for out, problem in ((tmp_path, "is a folder"), (tmp_path / "a-file" / "r.parquet", "a-file is not a folder")):
        result = cli(*command, option, out)
        assert result.returncode == 2 and f"qcg: error: {option} {out}" in result.stderr and problem in result.stderr


def test_write_failures_end_in_one_line_and_publish_nothing(tmp_path, cli, monkeypatch):
    import errno

    from qcg_gpu import index_format

    from .conftest import sample_docs

    docs = sample_docs(tmp_path / "docs", 2)
    build = ("index", "build", docs)
    options = ("--nodes", "sentence", "--device", "cpu", "--quiet")
    (tmp_path / "a-file").write_text("")
    for target in (tmp_path / "a-file" / "index", "/proc/qcg-index"):  # refused before any work
        result = cli(*build, target, *options)
        assert result.returncode == 2 and f"cannot write the index at {target}" in result.stderr, result.stderr

    def disk_full(*args, **kwargs):  # the disk fills up while the index is written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_format.np.lib.format, "write_array_header_1_0", disk_full)
    result = cli(*build, tmp_path / "index", *options)
    assert result.returncode == 2 and "No space left on device" in result.stderr, result.stderr
    assert "nothing was published" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "docs"]  # no index, no leftover

    monkeypatch.undo()  # now a disk that has less room than the index needs: refused before any write
    from types import SimpleNamespace

    from qcg_gpu.indexing import stages

    monkeypatch.setattr(stages.shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9, free=4096))
    result = cli(*build, tmp_path / "index", *options)  # the chunks alone do not fit: refused before any model
    assert result.returncode == 2 and "chunks alone need" in result.stderr and "nothing was generated" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "load_embedder" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "docs"]

    frees = iter([10**12, 4096])  # room at the start, the disk full by the time the index is written
    monkeypatch.setattr(stages.shutil, "disk_usage", lambda path: SimpleNamespace(total=0, used=0, free=next(frees)))
    result = cli(*build, tmp_path / "index", *options)
    assert result.returncode == 2 and "GB and 0.00 GB are free there; nothing was written" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "docs"]


def test_a_build_whose_expected_index_does_not_fit_is_warned_of_before_any_model_runs(tmp_path, monkeypatch, capsys):
    """Pair nodes: at least the chunks' texts and embeddings, expected M pair embeddings and ceil(alpha M)
    nodes a chunk on top; a disk between the two gets a warning before generation, not a refusal."""
    from types import SimpleNamespace

    from qcg_gpu.config import IndexConfig
    from qcg_gpu.indexing import stages

    from .conftest import sample_docs

    config = IndexConfig()
    chunks = stages.read_chunks(sample_docs(tmp_path / "docs", 2), config, stages.IndexSummary(out=tmp_path))
    least, expected = stages.index_size(chunks, config, 384)
    assert least == sum(len(c.text.encode()) for c in chunks) + len(chunks) * 384 * 4
    assert expected == least + len(chunks) * (20 * 384 * 4 + 16 * (384 * 4 + 2 * 12))  # M 20, alpha 0.8, k 2
    free = (least + expected) // 2
    monkeypatch.setattr(stages.shutil, "disk_usage", lambda path: SimpleNamespace(total=0, used=0, free=free))
    capsys.readouterr()
    stages.check_room(tmp_path / "index", chunks, config, 384)
    assert f"will need about {expected / 1e9:.2f} GB" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--embedder", "--tokenizer"])
def test_a_model_name_that_is_nowhere_is_refused_before_any_work(tmp_path, cli, option):
    # neither packaged, a local path, nor in the HF cache, and no hub to ask (or none that has it):
    # one line at once, instead of transformers retrying the hub for a minute after the LLM's work
    result = cli("index", "build", tmp_path, tmp_path / "out", "--nodes", "sentence", option, "no-such-org/no-model")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "model 'no-such-org/no-model' is not a packaged model, a local path or in the HF cache" in result.stderr
    assert not (tmp_path / "out").exists()


def _option_groups(parser) -> dict[str, set[str]]:
    return {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}


def test_option_groups_are_made_from_the_settings_concerns():
    """Each concern of GenerationConfig is one group of `qcg index build --help`, and `qcg answer`
    offers the answering LLM's concerns only: no list of option names kept by hand (issue 38 §3)."""
    import dataclasses

    from qcg_gpu.cli import build_parser
    from qcg_gpu.config import ANSWERING_LLM_CONCERNS, GENERATION_CONCERNS

    def fields(concern):
        return {f.name for f in dataclasses.fields(concern)}

    subparsers = build_parser()._subparsers._group_actions[0].choices
    build = _option_groups(subparsers["index"]._subparsers._group_actions[0].choices["build"])
    generation = [dests for title, dests in build.items() if title.startswith("generation options")]
    assert generation == [fields(concern) for concern in GENERATION_CONCERNS]
    answer = [dests for title, dests in _option_groups(subparsers["answer"]).items() if "answering LLM" in title]
    assert answer == [fields(concern) for concern in ANSWERING_LLM_CONCERNS]
