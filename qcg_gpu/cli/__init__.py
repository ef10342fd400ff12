"""The ``qcg`` command, one module per subcommand (each with ``add_parser`` and ``run``):

=============  ===================================================================
``index``      ``qcg index build|add|remove|plan`` (older spellings still work)
``query``      ``qcg query`` and ``qcg answer``
``evaluate``   ``qcg eval``
``report``     ``qcg report``: report.html of a ``qcg eval`` folder, made again
``check``      ``qcg check``
``models``     ``qcg models [list|install NAME]``
``corpus``     ``qcg corpus``
``bench``      ``qcg bench``: this machine's speed at each step
``init``       ``qcg init``: a config file with every default (any command reads one with ``--config``)
``options``    options made from the config dataclasses, shared by the subcommands
=============  ===================================================================

Only a :class:`QCGError` (bad input or setup, a missing optional dependency included) becomes a
one-line message; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..config.files import read_config_file
from ..errors import QCGError
from ..log import set_verbosity
from . import bench, check, corpus, evaluate, index, init, models, query, report
from .options import pop_config_file

SUBCOMMANDS = (index, query, evaluate, report, check, models, corpus, bench, init)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qcg", description="QCG-RAG batch engine")
    parser.add_argument(
        "--config",
        help="a TOML/YAML file of settings (qcg init writes one; any position): it overrides the defaults, a "
        "--preset or the settings of a stored generation override it, and options given here override all",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for subcommand in SUBCOMMANDS:
        subcommand.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_arguments(list(sys.argv[1:] if argv is None else argv))
        # progress bars and stage messages go through the qcg_gpu logger; vLLM's own log only with --verbose
        set_verbosity(quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False))
        return args.run(args)
    except QCGError as exc:
        print(f"qcg: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; writes are atomic and replies cached
        print(
            "qcg: interrupted (nothing half-written was published; a rerun reuses cached LLM replies)", file=sys.stderr
        )
        return 130


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The command line, over the settings of a --config file when one is given."""
    config_file, argv = pop_config_file(argv)
    settings = read_config_file(config_file) if config_file else {}  # a bad file is refused before any work
    args = build_parser().parse_args(index.current_spelling(argv))
    args.config_file_settings = settings  # below presets and options given: options.resolve
    return args
