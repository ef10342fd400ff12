"""Texts longer than the embedder's limit are embedded whole (the real MiniLM, real LiHuaWorld logs)."""

from __future__ import annotations

import numpy as np
import pytest

from qcg_gpu.embedding import Embedder
from qcg_gpu.errors import QCGError

from .conftest import SAMPLE_DOCS


@pytest.fixture(scope="module")
def truncating():
    return Embedder(device="cpu", long_texts="truncate")


def long_log() -> str:
    """The sample's three longest chat logs as one text (~1,000 word pieces, as long as a 1200-token chunk
    of LiHuaWorld): far over MiniLM's 256."""
    return "".join(sorted((p.read_text() for p in SAMPLE_DOCS.rglob("*.txt")), key=len)[-3:])


def tokens(embedder: Embedder, text: str) -> int:
    return len(embedder.model.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_long_texts_are_split_into_windows_that_fit_and_cover_the_text(embedder):
    text = long_log()
    windows = embedder.windows
    assert windows.limit == embedder.max_tokens - 2 == 254  # [CLS] and [SEP] take two of 256
    assert tokens(embedder, text) > 3 * windows.limit
    split = windows.split([text, "A short line."])
    assert split.windowed == 1 and split.owner.tolist() == [0] * (len(split.pieces) - 1) + [1]
    assert split.pieces[-1] == "A short line."
    for piece, weight in zip(split.pieces[:-1], split.weight):
        assert tokens(embedder, piece) == weight <= windows.limit  # each window is tokenized as it was in the text
    # in order, nothing lost: the windows are consecutive slices of the text (whitespace between them dropped)
    position = 0
    for piece in split.pieces[:-1]:
        found = text.index(piece, position)
        assert text[position:found].strip() == ""
        position = found + len(piece)
    assert text[position:].strip() == ""


def test_no_texts_give_an_empty_array(embedder):
    assert embedder.encode([]).shape == (0, embedder.dim)


def test_short_texts_embed_as_before(embedder, truncating):
    texts = ["What house rule does Adam mention?", "LiHua: Hey! Just wanted to check in about moving in."]
    np.testing.assert_array_equal(embedder.encode(texts), truncating.encode(texts))


def test_the_end_of_a_long_text_counts(embedder, truncating):
    """D2Q appends questions to a chunk: on a long chunk a truncating embedder never sees them."""
    chunk = long_log()
    questions = "\n".join(
        ["Which pizza place did Adam recommend to Li Hua?", "When is the house meeting with Adam?"] * 3
    )
    expanded = chunk + "\n" + questions
    before = embedder.windowed_texts
    whole = embedder.encode([chunk, expanded])
    assert embedder.windowed_texts == before + 2  # counted for the manifest
    cut = truncating.encode([chunk, expanded])
    np.testing.assert_array_equal(cut[0], cut[1])  # the questions fall past the limit: same embedding as the chunk
    assert float(whole[0] @ whole[1]) < 0.999  # embedded whole, the questions move the chunk's embedding
    np.testing.assert_allclose(np.linalg.norm(whole, axis=1), 1.0, atol=1e-6)
    # the whole-text embedding is the token-weighted mean of its windows' embeddings
    split = embedder.windows.split([chunk])
    pieces = embedder.encode_pieces(split.pieces)
    mean = (pieces * split.weight[:, None]).sum(0)
    np.testing.assert_allclose(whole[0], mean / np.linalg.norm(mean), atol=1e-6)


def test_bad_long_text_mode():
    with pytest.raises(QCGError, match="long_texts must be one of mean, truncate"):
        Embedder(device="cpu", long_texts="chop")


def test_indexes_recorded_before_the_option_keep_truncating():
    """An index built before --long-texts existed embedded long texts truncated: queries and --add on it
    must do the same, while a stored generation (no nodes section) takes today's default."""
    from qcg_gpu.config import IndexConfig

    assert IndexConfig.from_dict({"nodes": {"alpha": 0.8}}).nodes.long_texts == "truncate"
    assert IndexConfig.from_dict({"nodes": {"long_texts": "mean"}}).nodes.long_texts == "mean"
    assert IndexConfig.from_dict({"generation": {"m": 10}}).nodes.long_texts == "mean"


def test_an_embedding_does_not_depend_on_its_batch(embedder):
    """Bit for bit: alone, among other texts of any length, in any order (issue 15: --add equals a rebuild)."""
    lines = [line for path in sorted(SAMPLE_DOCS.rglob("*.txt"))[:6] for line in path.read_text().splitlines() if line]
    texts = ["Great!", "Thanks!", "😊", *lines[:150], long_log()[:3000]]
    together = embedder.encode(texts)
    alone = np.vstack([embedder.encode([text]) for text in texts[:3] + texts[-2:]])
    np.testing.assert_array_equal(alone, np.vstack([together[:3], together[-2:]]))
    order = np.random.default_rng(0).permutation(len(texts))
    np.testing.assert_array_equal(embedder.encode([texts[i] for i in order]), together[order])
    # the same vectors sentence-transformers gives, to float32 rounding
    reference = embedder.model.encode(texts[:-1], normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(together[:-1], reference, atol=2e-6)
