import pytest

from qcg_gpu import documents
from qcg_gpu.chunking import chunk_document, load_tokenizer
from qcg_gpu.config import ChunkingConfig
from qcg_gpu.documents import SkipLog, read_documents
from qcg_gpu.errors import QCGError
from qcg_gpu.models import bundled_embedder_dir

from .conftest import SAMPLE_DOCS


def _long_text() -> str:
    return "".join(p.read_text() for p in sorted((SAMPLE_DOCS / "week1").glob("*.txt")))


def _expected_windows(text: str, tokenizer, size: int, overlap: int) -> list[str]:
    starts = tokenizer.token_starts(text)
    windows, pos = [], 0
    while len(starts) - pos > size:
        windows.append(text[starts[pos] : starts[pos + size]])
        pos += size - overlap
    windows.append(text[starts[pos] :])
    return windows


@pytest.mark.parametrize("size,overlap", [(1200, 100), (512, 64), (50, 0)])
def test_windows_have_size_and_overlap(size, overlap):
    text = _long_text()
    tokenizer = load_tokenizer("cl100k_base")
    chunks = list(chunk_document("d", [text], tokenizer, ChunkingConfig(size, overlap)))
    assert [c.text for c in chunks] == _expected_windows(text, tokenizer, size, overlap)
    assert all(c.n_tokens == size for c in chunks[:-1]) and 0 < chunks[-1].n_tokens <= size
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert "".join(c.text for c in chunks) != text or overlap == 0  # overlap repeats text
    if overlap == 0:
        assert "".join(c.text for c in chunks) == text


def test_streamed_file_chunks_like_whole_text(tmp_path, monkeypatch):
    text = _long_text() * 3
    (tmp_path / "big.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(documents, "READ_BLOCK_BYTES", 700)  # many pieces, cut at line breaks
    [doc] = list(read_documents(tmp_path, SkipLog()))
    pieces = list(doc.pieces())
    assert len(pieces) > 20 and "".join(pieces) == text
    tokenizer = load_tokenizer("cl100k_base")
    config = ChunkingConfig(200, 20)
    streamed = [c.text for c in chunk_document("big", pieces, tokenizer, config)]
    assert streamed == _expected_windows(text, tokenizer, 200, 20)


def test_hf_tokenizer_counts_its_own_tokens():
    tokenizer = load_tokenizer(str(bundled_embedder_dir()))
    text = _long_text()
    chunks = list(chunk_document("d", [text], tokenizer, ChunkingConfig(128, 16)))
    assert len(chunks) > 3
    assert all(len(tokenizer.token_starts(c.text)) <= 128 + 2 for c in chunks)  # re-tokenising a cut may merge at most at the edges


def test_multibyte_text_is_never_cut_inside_a_character():
    text = "héllo 🎉 wörld " * 300
    chunks = list(chunk_document("d", [text], load_tokenizer("cl100k_base"), ChunkingConfig(7, 2)))
    assert all("\ufffd" not in c.text for c in chunks)
    assert chunks[0].text.startswith("héllo")


@pytest.mark.parametrize("size,overlap", [(0, 0), (100, 100), (100, -1)])
def test_bad_chunking_settings(size, overlap):
    with pytest.raises(QCGError):
        ChunkingConfig(size, overlap).validate()
