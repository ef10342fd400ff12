"""Reading input documents: a directory of .txt/.md files, JSONL, a JSON list or Parquet.

Records (JSONL, JSON, Parquet) hold ``doc_id`` (or BEIR's ``_id``) and ``text``, and an optional
``title`` that is put first, on a line of its own (BEIR, HippoRAG). A record without an id is
named by its title, repeated titles numbered ``Title (2)``, ... (HippoRAG's corpora).

Documents are streamed as text pieces so that a huge file never has to sit in
memory whole. Problems with single documents (empty, not UTF-8, binary,
duplicate id, malformed line) are skips recorded in a :class:`SkipLog`; only a
problem with the input as a whole (nothing readable at all) is an error.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QCGError

TEXT_SUFFIXES = (".txt", ".md")
READ_BLOCK_BYTES = 1 << 20
MAX_PIECE_CHARS = 16 << 20
_LINE_START = re.compile(r"\n(?=\S)")


@dataclass
class Document:
    doc_id: str
    pieces: Callable[[], Iterator[str]]  # yields the text in order; each piece ends on a line break when it can


@dataclass
class SkipLog:
    """Documents (or lines) left out, with the reason, for the run summary."""

    items: list[tuple[str, str]] = field(default_factory=list)

    def add(self, what: str, reason: str) -> None:
        self.items.append((what, reason))


def read_documents(path: str | os.PathLike, skips: SkipLog) -> Iterator[Document]:
    """Documents of ``path`` (directory, .jsonl or .parquet), duplicates and empties skipped. A missing
    path, an empty folder, or a file that is not of its kind is refused now, before any document is read."""
    path = Path(path)
    if not path.exists():
        raise QCGError(f"input not found: {path}")
    if path.is_dir():
        source = _read_directory(path, skips)
    elif path.suffix == ".jsonl":
        source = _read_jsonl(path, skips)
    elif path.suffix == ".json":
        source = _read_json_list(path, skips)
    elif path.suffix == ".parquet":
        source = _read_parquet(path, skips)
    elif path.suffix in TEXT_SUFFIXES:
        source = _read_directory_files(path.parent, [path], skips)
    else:
        raise QCGError(
            f"unsupported input {path}: give a directory of .txt/.md files, a .jsonl, .json (a list) or .parquet file"
        )
    return _first_of_each_id(source, skips)


def _first_of_each_id(source: Iterator[Document], skips: SkipLog) -> Iterator[Document]:
    seen: set[str] = set()
    for doc in source:
        if doc.doc_id in seen:
            skips.add(doc.doc_id, "duplicate doc_id (first one kept)")
            continue
        seen.add(doc.doc_id)
        yield doc


# -- directories -------------------------------------------------------------


def _read_directory(root: Path, skips: SkipLog) -> Iterator[Document]:
    files = []
    # os.walk does not follow symlinked directories, so symlink loops cannot trap it.
    for dirpath, dirnames, filenames in os.walk(
        root, onerror=lambda e: skips.add(str(e.filename), f"unreadable: {e.strerror}")
    ):
        dirnames.sort()
        files += [Path(dirpath, name) for name in sorted(filenames) if name.endswith(TEXT_SUFFIXES)]
    if not files:
        raise QCGError(f"no .txt or .md files under {root}")
    return _read_directory_files(root, files, skips)


def _read_directory_files(root: Path, files: list[Path], skips: SkipLog) -> Iterator[Document]:
    for file in files:
        doc_id = file.relative_to(root).with_suffix("").as_posix()
        if not is_unicode(doc_id):  # os.fsdecode keeps undecodable bytes as lone surrogates
            skips.add(os.fsencode(doc_id).decode("utf-8", "backslashreplace"), "file name is not UTF-8")
            continue
        problem = _check_text_file(file)
        if problem:
            skips.add(doc_id, problem)
            continue
        yield Document(doc_id, functools.partial(_stream_file, file))


def _check_text_file(file: Path) -> str | None:
    """Why ``file`` cannot be used as a document, or None. Reads it once in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    offset, has_text = 0, False
    try:
        with open(file, "rb") as fh:
            while block := fh.read(READ_BLOCK_BYTES):
                if b"\x00" in block:
                    return "binary file (NUL bytes)"
                try:
                    text = decoder.decode(block)  # every block, also once text was seen: a bad byte may come late
                except UnicodeDecodeError as exc:  # exc.object ends with the block (less a BOM, plus carried bytes)
                    return f"not UTF-8 (bad byte at offset {offset + len(block) - len(exc.object) + exc.start})"
                has_text = has_text or bool(text.strip())
                offset += len(block)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return "not UTF-8 (truncated character at end of file)"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    return None if has_text else "empty document"


def _stream_file(file: Path) -> Iterator[str]:
    """The file's text in pieces of about READ_BLOCK_BYTES.

    A piece ends after a line break that is followed by a visible character:
    no token of any usual tokenizer spans such a cut, so pieces can be
    tokenised one by one. Text without such a place is carried on, up to
    MAX_PIECE_CHARS, then cut at the last space.
    """
    carry = ""
    with open(file, encoding="utf-8-sig", newline="") as fh:
        while block := fh.read(READ_BLOCK_BYTES):
            text = carry + block
            cut = _last_line_start(text)
            if cut == 0 and len(text) > MAX_PIECE_CHARS:
                cut = text.rfind(" ") + 1 or len(text)
            carry = text[cut:]
            if cut:
                yield text[:cut]
    if carry:
        yield carry


def _last_line_start(text: str) -> int:
    """Offset of the last line start followed by a visible character (0 if none)."""
    last = None
    for last in _LINE_START.finditer(text, max(0, len(text) - READ_BLOCK_BYTES)):  # noqa: B007 (the last one is kept)
        pass
    return last.end() if last else 0


# -- JSONL and Parquet ------------------------------------------------------------


def _record_document(doc_id, text, where: str, skips: SkipLog) -> Document | None:
    if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool) or str(doc_id) == "":
        skips.add(where, "missing or invalid doc_id")
        return None
    if not isinstance(text, str):
        skips.add(str(doc_id), "missing or non-string text")
        return None
    if not (is_unicode(str(doc_id)) and is_unicode(text)):  # JSON may escape half a surrogate pair
        skips.add(where, "doc_id or text holds a lone surrogate (not Unicode text)")
        return None
    if not text.strip():
        skips.add(str(doc_id), "empty document")
        return None
    return Document(str(doc_id), functools.partial(iter, (text,)))


def is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def record_text(record: dict):
    """A record's text, its title (if any) first on a line of its own: HippoRAG's passage layout."""
    text, title = record.get("text"), record.get("title")
    return f"{title}\n{text}" if isinstance(title, str) and title.strip() and isinstance(text, str) else text


class RecordNamer:
    """Each record's doc id, in input order: ``doc_id`` or ``_id``, else its title, a repeated title
    numbered ``Title (2)``, ``Title (3)``, ..."""

    def __init__(self) -> None:
        self.titles = Counter[str]()

    def __call__(self, record: dict):
        given, title = record.get("doc_id", record.get("_id")), record.get("title")
        if given is None and isinstance(title, str) and title.strip():
            self.titles[title] += 1
            given = title if self.titles[title] == 1 else f"{title} ({self.titles[title]})"
        return given


def _read_json_list(path: Path, skips: SkipLog) -> Iterator[Document]:
    try:
        records = json.loads(path.read_text(encoding="utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QCGError(f"{path}: not a UTF-8 JSON file ({exc})") from exc
    if not isinstance(records, list):
        raise QCGError(f"{path}: a .json input must hold a list of {{doc_id or title, text}} records")
    return _json_records(path, records, skips)


def _json_records(path: Path, records: list, skips: SkipLog) -> Iterator[Document]:
    name = RecordNamer()
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            skips.add(f"{path.name}[{i}]", "not a JSON object")
        elif doc := _record_document(name(record), record_text(record), f"{path.name}[{i}]", skips):
            yield doc


def _read_jsonl(path: Path, skips: SkipLog) -> Iterator[Document]:
    name = RecordNamer()
    with open(path, encoding="utf-8-sig", errors="strict") as fh:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = fh.readline()
            except UnicodeDecodeError as exc:
                raise QCGError(f"{path}: not UTF-8 near line {lineno}") from exc
            if not line:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                skips.add(f"{path.name}:{lineno}", f"invalid JSON ({exc.msg})")
                continue
            if not isinstance(record, dict):
                skips.add(f"{path.name}:{lineno}", "not a JSON object")
                continue
            doc = _record_document(name(record), record_text(record), f"{path.name}:{lineno}", skips)
            if doc:
                yield doc


def _read_parquet(path: Path, skips: SkipLog) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise QCGError(f"{path}: not a readable Parquet file ({exc})") from exc
    missing = {"doc_id", "text"} - set(file.schema_arrow.names)
    if missing:
        raise QCGError(
            f"{path}: Parquet input needs columns doc_id and text; missing {sorted(missing)} (has "
            f"{file.schema_arrow.names})"
        )
    return _parquet_rows(path, file, skips)


def _parquet_rows(path: Path, file, skips: SkipLog) -> Iterator[Document]:
    row = 0
    for batch in file.iter_batches(columns=["doc_id", "text"], batch_size=1024):
        for doc_id, text in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
            doc = _record_document(doc_id, text, f"{path.name}:row {row}", skips)
            row += 1
            if doc:
                yield doc
