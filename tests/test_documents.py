import codecs
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qcg_gpu.errors import QCGError
from qcg_gpu.indexing import documents
from qcg_gpu.indexing.documents import SkipLog, read_documents


def _read(path):
    skips = SkipLog()
    docs = {doc.doc_id: "".join(doc.pieces()) for doc in read_documents(path, skips)}
    return docs, dict(skips.items)


def test_directory_ids_are_relative_paths_without_suffix(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.txt").write_text("hello")
    (tmp_path / "top.md").write_text("# title\nbody")
    (tmp_path / "ignored.csv").write_text("not a document")
    docs, skips = _read(tmp_path)
    assert docs == {"a/b/x": "hello", "top": "# title\nbody"}
    assert skips == {}


def test_directory_bad_files_are_skipped_with_reasons(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "empty.txt").write_text("  \n ")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02abc")
    (tmp_path / "loop").symlink_to(tmp_path)  # a symlink loop must not hang the walk
    docs, skips = _read(tmp_path)
    assert list(docs) == ["good"]
    assert skips["empty"] == "empty document"
    assert skips["latin1"].startswith("not UTF-8 (bad byte at offset 3)")
    assert skips["binary"].startswith("binary file")


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Windows editors begin UTF-8 files with U+FEFF: it must not reach a chunk, nor spoil a JSON line."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("Hello there", encoding="utf-8-sig")
    (tmp_path / "docs" / "blank.md").write_text(" \n", encoding="utf-8-sig")
    assert _read(tmp_path / "docs") == ({"a": "Hello there"}, {"blank": "empty document"})
    (tmp_path / "d.jsonl").write_text('{"doc_id": "d1", "text": "one"}\n', encoding="utf-8-sig")
    (tmp_path / "d.json").write_text('[{"doc_id": "d1", "text": "one"}]', encoding="utf-8-sig")
    assert _read(tmp_path / "d.jsonl") == _read(tmp_path / "d.json") == ({"d1": "one"}, {})


def test_names_and_texts_that_are_not_unicode_are_skipped(tmp_path):
    """A Latin-1 file name, or a JSON line escaping half a surrogate pair: the index tables (UTF-8) could
    not hold them, and the build ended in a traceback after all its LLM work."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.txt").write_text("fine")
    with open(os.fsencode(tmp_path / "docs") + b"/caf\xe9.txt", "w") as fh:
        fh.write("a readable text")
    assert _read(tmp_path / "docs") == ({"ok": "fine"}, {"caf\\xe9": "file name is not UTF-8"})
    lines = [
        '{"doc_id": "a", "text": "half \\udce9 a pair"}',
        '{"doc_id": "b\\ud800", "text": "x"}',
        '{"doc_id": "c", "text": "ok"}',
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    lone = "doc_id or text holds a lone surrogate (not Unicode text)"
    assert _read(tmp_path / "d.jsonl") == ({"c": "ok"}, {"d.jsonl:1": lone, "d.jsonl:2": lone})


@pytest.mark.parametrize("bom", [b"", codecs.BOM_UTF8])
def test_a_bad_byte_after_the_first_block_is_found(tmp_path, monkeypatch, bom):
    """The check decodes every block: a log that is ASCII for its first MiB, then Latin-1, crashed the build."""
    monkeypatch.setattr(documents, "READ_BLOCK_BYTES", 8)
    # 24 ASCII bytes, then an é split across blocks (offsets 27-28), then a Latin-1 é at offset 30
    (tmp_path / "log.txt").write_bytes(bom + b"hello world\n" * 2 + "caf\u00e9 ".encode() + "\xe9\n".encode("latin-1"))
    assert _read(tmp_path) == ({}, {"log": f"not UTF-8 (bad byte at offset {len(bom) + 30})"})


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_skipped(tmp_path):
    (tmp_path / "secret.txt").write_text("x")
    os.chmod(tmp_path / "secret.txt", 0)
    _, skips = _read(tmp_path)
    assert skips["secret"].startswith("unreadable")


def test_empty_directory_is_an_error(tmp_path):
    with pytest.raises(QCGError, match="no .txt or .md files"):
        _read(tmp_path)


def test_missing_input_is_an_error(tmp_path):
    with pytest.raises(QCGError, match="input not found"):
        _read(tmp_path / "nope")


def test_jsonl_with_bad_lines_and_duplicates(tmp_path):
    lines = [
        json.dumps({"doc_id": "d1", "text": "first"}),
        "{not json",
        json.dumps({"doc_id": "d1", "text": "again"}),
        json.dumps({"text": "no id"}),
        json.dumps({"doc_id": 7, "text": "int ids are kept as strings"}),
        json.dumps({"doc_id": "d3", "text": ""}),
        "",
        json.dumps(["a list"]),
    ]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines))
    docs, skips = _read(path)
    assert docs == {"d1": "first", "7": "int ids are kept as strings"}
    assert skips["docs.jsonl:2"].startswith("invalid JSON")
    assert skips["d1"] == "duplicate doc_id (first one kept)"
    assert skips["docs.jsonl:4"] == "missing or invalid doc_id"
    assert skips["d3"] == "empty document"
    assert skips["docs.jsonl:8"] == "not a JSON object"


def test_a_plan_and_a_build_summary_name_the_skipped_lines(tmp_path):
    from qcg_gpu.config import IndexConfig
    from qcg_gpu.indexing.forecast import forecast
    from qcg_gpu.indexing.stages import IndexSummary

    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join([json.dumps({"doc_id": "d1", "text": "kept"})] + [f"{{bad {i}" for i in range(12)]))
    plan = forecast(path, IndexConfig()).format()
    assert "dry run: 1 document (12 skipped), 1 chunk," in plan, plan
    assert "skipped docs.jsonl:2: invalid JSON" in plan and "docs.jsonl:11:" in plan and "docs.jsonl:12:" not in plan
    assert "... and 2 more skipped (a build's manifest.json lists them all)" in plan
    summary = IndexSummary(out=tmp_path / "idx", skipped=[(f"d{i}", "empty document") for i in range(11)]).format()
    assert "skipped d9: empty document" in summary and "skipped d10" not in summary
    assert f"... and 1 more skipped ({tmp_path / 'idx'}/manifest.json lists them all)" in summary


def test_parquet_input(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b", "a"], "text": ["x", None, "y"], "extra": [1, 2, 3]}), path)
    docs, skips = _read(path)
    assert docs == {"a": "x"}
    assert skips == {"b": "missing or non-string text", "a": "duplicate doc_id (first one kept)"}


def test_parquet_without_expected_columns(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), path)
    with pytest.raises(QCGError, match=r"missing \['doc_id', 'text'\]"):
        _read(path)


def test_not_a_parquet_file(tmp_path):
    path = tmp_path / "docs.parquet"
    path.write_text("garbage")
    with pytest.raises(QCGError, match="not a readable Parquet file"):
        _read(path)


def test_unsupported_input(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("a,b")
    with pytest.raises(QCGError, match="unsupported input"):
        _read(path)


def test_dangling_symlink_is_skipped_as_unreadable(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "deleted.txt")  # unreadable even for root
    docs, skips = _read(tmp_path)
    assert list(docs) == ["good"] and skips["gone"].startswith("unreadable")


def test_a_200_mb_document_streams_in_bounded_pieces(tmp_path):
    import tracemalloc

    from qcg_gpu.indexing.documents import MAX_PIECE_CHARS, READ_BLOCK_BYTES

    line = "Li Hua: the parcel room opens at nine and closes at five on weekdays.\n"
    with open(tmp_path / "huge.txt", "w") as fh:
        for _ in range(200):
            fh.write(line * ((1 << 20) // len(line)))
    [doc] = read_documents(tmp_path, SkipLog())
    tracemalloc.start()
    total, longest = 0, 0
    for piece in doc.pieces():
        total, longest = total + len(piece), max(longest, len(piece))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert total == (tmp_path / "huge.txt").stat().st_size > 199 << 20
    assert longest <= READ_BLOCK_BYTES + len(line) < MAX_PIECE_CHARS
    assert peak < 32 << 20  # never the whole document in memory


def test_100k_tiny_documents(tmp_path):
    from qcg_gpu.config import ChunkingConfig
    from qcg_gpu.indexing.chunking import chunk_document, load_tokenizer

    with open(tmp_path / "tiny.jsonl", "w") as fh:
        for i in range(100_000):
            fh.write(json.dumps({"doc_id": f"d{i}", "text": f"note {i}: buy milk"}) + "\n")
    tokenizer, config = load_tokenizer("cl100k_base"), ChunkingConfig()
    chunks = [
        c
        for doc in read_documents(tmp_path / "tiny.jsonl", SkipLog())
        for c in chunk_document(doc.doc_id, doc.pieces(), tokenizer, config)
    ]
    assert len(chunks) == 100_000 and len({c.doc_id for c in chunks}) == 100_000
    assert chunks[-1].text == "note 99999: buy milk"
