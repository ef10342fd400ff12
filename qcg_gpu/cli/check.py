"""``qcg check``: verify an index in full; exit code 0 when sound, 1 with a list of problems."""

from __future__ import annotations


def add_parser(commands) -> None:
    check = commands.add_parser(
        "check",
        help="verify an index: checksums, shapes, norms, kNN graph, tables",
        description="Verify an index in full; exit code 0 when sound, 1 with a list of problems.",
    )
    check.add_argument("index", help="index directory")
    check.add_argument("--no-checksums", action="store_true", help="skip the sha256 of every file (structure only)")
    check.set_defaults(run=run)


def run(args) -> int:
    from ..check import check_index

    problems = check_index(args.index, checksums=not args.no_checksums)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"{args.index}: " + (f"{len(problems)} problem(s) found" if problems else "sound"))
    return 1 if problems else 0
