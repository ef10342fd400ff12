"""``qcg init [FILE]``: write a config file with every option at its default, each with its help."""

from __future__ import annotations

from pathlib import Path

from ..config.files import config_file_text
from ..errors import QCGError


def add_parser(commands) -> None:
    init = commands.add_parser(
        "init",
        help="write a config file (TOML) with every option's default",
        description="Write a config file with every option at its default and its help as a comment; edit it, "
        "then run any command with --config FILE (options given on the command line win).",
    )
    init.add_argument("file", nargs="?", default="qcg.toml", help="where to write it (default: qcg.toml)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(run=run)


def run(args) -> int:
    path = Path(args.file)
    if path.suffix != ".toml":
        raise QCGError(f"{path}: qcg init writes TOML; name the file .toml")
    if path.exists() and not args.force:
        raise QCGError(f"{path} exists (--force overwrites it)")
    try:
        path.write_text(config_file_text(), encoding="utf-8")
    except OSError as exc:  # a missing folder, a folder by that name, no permission
        raise QCGError(f"cannot write {path}: {exc.strerror}") from exc
    print(f"wrote {path}: every option at its default; use it with --config {path}")
    return 0
