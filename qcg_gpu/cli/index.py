"""``qcg index build|add|remove|plan``: build an index, add or remove documents, forecast a build.

The spellings from before the subcommands still work (:func:`current_spelling`):
``qcg index INPUT OUT``, ``qcg index --add INPUT INDEX``, ``qcg index INDEX --remove DOC_ID ...``
and ``qcg index INPUT OUT --dry-run``.
"""

from __future__ import annotations

import argparse
import os

from ..config import IndexConfig
from ..errors import QCGError
from ..log import counted
from .options import add_generation_options, add_options, add_output_options, add_ray_options, ray_cluster, resolve

ACTIONS = ("build", "add", "remove", "retry", "plan")
INPUT_HELP = (
    "directory of .txt/.md files (recursive), a .jsonl file ({doc_id, text} per line) or a .parquet file "
    "(doc_id, text columns)"
)


def current_spelling(argv: list[str]) -> list[str]:
    """``argv`` with an older ``qcg index`` spelling rewritten as its subcommand."""
    if len(argv) < 2 or argv[0] != "index" or argv[1] in (*ACTIONS, "-h", "--help"):
        return argv
    rest = argv[1:]
    if "--remove" in rest:
        at = rest.index("--remove")
        end = next((i for i in range(at + 1, len(rest)) if rest[i].startswith("-")), len(rest))
        doc_ids, others = rest[at + 1 : end], rest[:at] + rest[end:]
        positional = [i for i, token in enumerate(others) if not token.startswith("-")][:1]
        place = positional[0] + 1 if positional else 0
        return ["index", "remove", *others[:place], *doc_ids, *others[place:]]
    if "--dry-run" in rest:
        return ["index", "plan", *[token for token in rest if token != "--dry-run"]]
    if "--add" in rest:
        return ["index", "add", *[token for token in rest if token != "--add"]]
    if "--retry-failed" in rest:
        return ["index", "retry", *[token for token in rest if token != "--retry-failed"]]
    return ["index", "build", *rest]


def add_parser(commands) -> None:
    index = commands.add_parser(
        "index",
        help="build an index, add or remove documents, or forecast a build",
        description="Build a QCG-RAG index, or change one:\n"
        "  qcg index build INPUT OUT           build (older spelling: qcg index INPUT OUT)\n"
        "  qcg index add INPUT INDEX           add documents (qcg index --add INPUT INDEX)\n"
        "  qcg index remove INDEX DOC_ID ...   remove documents (qcg index INDEX --remove DOC_ID ...)\n"
        "  qcg index retry INDEX               regenerate failed chunks, then update (qcg index --retry-failed INDEX)\n"
        "  qcg index plan INPUT [OUT]          forecast chunks, LLM tokens and time (qcg index INPUT OUT --dry-run)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = index.add_subparsers(dest="action", required=True)

    build = actions.add_parser("build", help="build an index of INPUT's documents into OUT")
    build.add_argument("input", help=INPUT_HELP)
    build.add_argument("out", help="index directory to create")
    build.add_argument("--overwrite", action="store_true", help="replace an existing index at OUT (atomically)")
    _add_build_options(build)
    build.set_defaults(run=run_build)

    add = actions.add_parser(
        "add",
        help="add INPUT's documents to the index INDEX (pairs only for new chunks, kNN "
        "edges updated, not rebuilt; the index's own settings are used)",
    )
    add.add_argument("input", help=INPUT_HELP)
    add.add_argument("out", metavar="index", help="the index to add to")
    _add_build_options(add)
    add.set_defaults(run=run_add)

    remove = actions.add_parser("remove", help="remove documents from an index")
    remove.add_argument("index", help="the index to remove from")
    remove.add_argument("doc_ids", nargs="+", metavar="DOC_ID", help="documents to remove")
    add_output_options(remove)
    add_ray_options(remove)
    remove.set_defaults(run=run_remove)

    retry = actions.add_parser(
        "retry",
        help="generate the chunks whose LLM request failed, then update the index like add (no rebuild; the "
        "documents they belong to move to the end)",
    )
    retry.add_argument("out", metavar="index", help="the index to repair")
    _add_build_options(retry)
    retry.set_defaults(run=run_retry)

    plan = actions.add_parser(
        "plan",
        help="forecast chunks, LLM tokens and generation time of a build (or, with "
        "--add, of adding INPUT to the index OUT), then stop",
    )
    plan.add_argument("input", help=INPUT_HELP)
    plan.add_argument("out", nargs="?", help="the index the build would write (with --add: the index to add to)")
    plan.add_argument("--add", action="store_true", help="forecast adding INPUT to the index OUT")
    _add_build_options(plan, ray=False)
    plan.set_defaults(run=run_plan)


def _add_build_options(parser, ray: bool = True) -> None:
    add_output_options(parser)
    defaults = IndexConfig()
    for name in IndexConfig.SECTIONS:
        if name == "generation":
            add_generation_options(parser)
        else:
            add_options(parser, getattr(defaults, name), f"{name} options")
    if ray:
        add_ray_options(parser)


def index_config(args, stored: dict | None = None) -> IndexConfig:
    """The build settings: defaults < config file < ``stored`` (the settings an index, or the stored
    generation of --replies-in, was made with: only those that change results) < the options given."""
    over = IndexConfig.stored_values(stored) if stored else {}
    config = IndexConfig()
    for name in IndexConfig.SECTIONS:
        resolve(getattr(config, name), args, over=over.get(name))
    return config


def build_config(args) -> IndexConfig:
    """:func:`index_config` over the settings of the --replies-in file (if any), so that
    ``qcg index build DOCS OUT --replies-in FILE`` rebuilds the index that file was made for."""
    replies_in = index_config(args).generation.replies_in
    if replies_in and os.path.isfile(replies_in):  # a missing file is refused by validate()
        from ..llm.cache import stored_settings

        return index_config(args, stored_settings(replies_in))
    return index_config(args)


def run_build(args) -> int:
    from ..indexing.pipeline import build_index

    config = build_config(args).validate()  # refuse bad settings before starting a cluster
    summary = build_index(args.input, args.out, config, overwrite=args.overwrite, cluster=ray_cluster(args))
    print(summary.format())
    return 3 if summary.failed_chunks else 0


def run_add(args) -> int:
    from ..index_format import read_manifest
    from ..indexing.incremental import add_documents, index_settings

    manifest = read_manifest(args.out)
    options = index_config(args, manifest["settings"])
    index_settings(manifest, options)  # refuse other settings before a cluster starts
    summary = add_documents(args.out, args.input, options, cluster=ray_cluster(args))
    print(summary.format("documents added to"))
    return 0


def run_retry(args) -> int:
    from ..index_format import read_manifest
    from ..indexing.incremental import index_settings, retry_failed

    manifest = read_manifest(args.out)
    options = index_config(args, manifest["settings"])
    index_settings(manifest, options)  # refuse other settings before a cluster starts
    summary = retry_failed(args.out, options, cluster=ray_cluster(args))
    print(summary.format(f"{counted(summary.documents, 'document')} regenerated in"))
    return 0


def run_remove(args) -> int:
    from ..index_format import index_shards, read_manifest
    from ..indexing.incremental import remove_documents

    if args.ray and len(index_shards(read_manifest(args.index))) < 2:  # before a cluster starts
        raise QCGError(
            f"--ray searches the kNN rows of an index stored in node shards, a task per shard; {args.index} "
            "is one shard, and its removal runs in this process (leave out --ray)"
        )
    summary = remove_documents(args.index, args.doc_ids, cluster=ray_cluster(args))
    removed = ", ".join(counted(n, noun) for n, noun in ((summary.chunks, "chunk"), (summary.nodes, "node")))
    print(f"removed {counted(summary.documents, 'document')} ({removed}) from {args.index}")
    return 0


def run_plan(args) -> int:
    from ..indexing.forecast import forecast

    if args.add:
        if not args.out:
            raise QCGError("qcg index plan --add needs the index to add to: qcg index plan INPUT INDEX --add")
        from ..index_format import read_manifest
        from ..indexing.incremental import index_settings

        manifest = read_manifest(args.out)
        config = index_settings(manifest, index_config(args, manifest["settings"]))
    else:
        config = build_config(args)
    print(forecast(args.input, config, add_to=args.out if args.add else None).format())
    return 0
