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
    from ..index_format import read_manifest
    from ..integrity import check_index
    from ..log import counted

    problems = check_index(args.index, checksums=not args.no_checksums)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    manifest = read_manifest(args.index)
    failed = manifest.get("failed_documents", {})
    for doc_id, error in failed.items():  # a sound index may still miss pairs
        print(f"FAILED document {doc_id}: {error} (qcg index retry {args.index})")
    if failed:
        documents = manifest.get("counts", {}).get("documents", len(failed))
        rest = "; the others are done" if documents > len(failed) else ""
        print(f"{len(failed)} of {counted(documents, 'document')} failed generation{rest}")
    print(f"{args.index}: " + (f"{counted(len(problems), 'problem')} found" if problems else "sound"))
    return 1 if problems else 0
