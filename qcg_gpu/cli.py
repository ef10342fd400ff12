"""Command line: ``qcg index INPUT OUT [options]``.

Options are generated from the config dataclasses, so each is documented once
(in qcg_gpu/config.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from .config import IndexConfig
from .errors import QCGError


def _add_dataclass_options(parser: argparse.ArgumentParser, section, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
            continue
        base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
        group.add_argument(
            flag, dest=f.name, type=base, default=f.default, choices=f.metadata.get("choices"),
            help=f.metadata["help"] + (f" (default: {f.default})" if f.default is not None else ""),
        )


def _config_from_args(args: argparse.Namespace) -> IndexConfig:
    config = IndexConfig()
    for name in IndexConfig.SECTIONS:
        section = getattr(config, name)
        for f in dataclasses.fields(section):
            setattr(section, f.name, getattr(args, f.name))
    return config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcg", description="QCG-RAG batch engine")
    commands = parser.add_subparsers(dest="command", required=True)
    index = commands.add_parser("index", help="build an index from documents", description="Build a QCG-RAG index.")
    index.add_argument("input", help="directory of .txt/.md files (recursive), a .jsonl file ({doc_id, text} per line) or a .parquet file (doc_id, text columns)")
    index.add_argument("out", help="index directory to create")
    index.add_argument("--overwrite", action="store_true", help="replace an existing index at OUT (atomically)")
    index.add_argument("--quiet", action="store_true", help="no progress bars")
    defaults = IndexConfig()
    for name in IndexConfig.SECTIONS:
        _add_dataclass_options(index, getattr(defaults, name), f"{name} options")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "index":
            from .pipeline import build_index

            summary = build_index(args.input, args.out, _config_from_args(args), overwrite=args.overwrite, progress=not args.quiet)
            print(summary.format())
            return 3 if summary.failed_chunks else 0
    except QCGError as exc:
        print(f"qcg: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # MissingDependency carries its install hint
        print(f"qcg: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
