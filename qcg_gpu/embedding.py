"""Sentence embeddings, l2-normalised, batched, on the GPU when there is one.

Texts longer than the embedder's limit (256 word pieces for all-MiniLM-L6-v2) would be cut
silently by the model; by default they are embedded whole instead: split into windows of
at most the limit, each window embedded, and the windows' embeddings averaged (weighted by
their token counts) and normalised (``long_texts="mean"``). ``"truncate"`` keeps the model's
own cut, as the paper's setup did.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .capabilities import default_device, require
from .errors import QCGError
from .log import progress_bar
from .models import DEFAULT_EMBEDDER, resolve_model

LONG_TEXT_MODES = ("mean", "truncate")


class Embedder:
    def __init__(
        self, model: str | None = None, device: str | None = None, batch_size: int = 128, long_texts: str = "mean"
    ):
        if long_texts not in LONG_TEXT_MODES:
            raise QCGError(f"long_texts must be one of {', '.join(LONG_TEXT_MODES)}, got {long_texts!r}")
        path, self.model_name = resolve_model(model, DEFAULT_EMBEDDER)
        sentence_transformers = require("sentence_transformers")
        self.device = device or default_device()
        self.batch_size = batch_size
        try:
            self.model = sentence_transformers.SentenceTransformer(path, device=self.device)
        except Exception as exc:
            raise QCGError(f"cannot load embedder {self.model_name!r}: {exc}") from exc
        self.dim = (
            self.model.get_embedding_dimension()
            if hasattr(self.model, "get_embedding_dimension")
            else self.model.get_sentence_embedding_dimension()
        )
        self.windows = Windows(self.model.tokenizer, self.model.max_seq_length) if long_texts == "mean" else None
        self.max_tokens = self.model.max_seq_length
        self.windowed_texts = 0  # texts embedded over several windows so far (reported in the manifest)

    def encode(self, texts: list[str], desc: str = "embed") -> np.ndarray:
        """float32 array (len(texts), dim), each row of unit length; ``desc`` names its progress bar."""
        return encode_whole(self, texts, lambda pieces: self.encode_pieces(pieces, desc))

    def encode_pieces(self, texts: list[str], desc: str = "embed") -> np.ndarray:
        """Each text through the model as it is (cut at the model's limit)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for rows in progress_bar(length_batches(texts, self.batch_size), desc=desc, unit="batch"):
            out[rows] = self.encode_batch([texts[i] for i in rows])
        return out

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        """One batch through the model, padded to its longest text."""
        vectors = self.model.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vectors, dtype=np.float32)


def encode_whole(embedder, texts: list[str], encode_pieces) -> np.ndarray:
    """``texts`` embedded whole through ``encode_pieces`` (a list of model-sized texts -> their
    vectors): long texts over their windows where ``embedder.windows`` is set."""
    if embedder.windows is None or not texts:
        return encode_pieces(texts)
    split = embedder.windows.split(texts)
    embedder.windowed_texts += split.windowed
    vectors = encode_pieces(split.pieces)
    return vectors if split.windowed == 0 else split.pool(vectors, len(texts))


@dataclass
class Split:
    pieces: list[str]  # what the model embeds: short texts whole, long ones as windows
    owner: np.ndarray  # (pieces,) the text each piece belongs to
    weight: np.ndarray  # (pieces,) its token count
    windowed: int  # texts that were split

    def pool(self, vectors: np.ndarray, n_texts: int) -> np.ndarray:
        """One unit vector per text: the token-weighted mean of its pieces' vectors, normalised."""
        out = np.zeros((n_texts, vectors.shape[1]), dtype=np.float64)
        np.add.at(out, self.owner, vectors * self.weight[:, None])
        out /= np.linalg.norm(out, axis=1, keepdims=True)
        return out.astype(np.float32)


class Windows:
    """Splits texts longer than the model's limit into consecutive windows that each fit it.

    Windows are cut at token boundaries in the original text (the fast tokenizer's offsets) and
    never inside a word, so each window is tokenized again as it was inside the whole text."""

    def __init__(self, tokenizer, max_seq_length: int):
        self.tokenizer = tokenizer
        # the model adds its special tokens ([CLS] ... [SEP]) to every window
        self.limit = max_seq_length - tokenizer.num_special_tokens_to_add(pair=False)
        if self.limit < 8:
            raise QCGError(f"the embedder's limit of {max_seq_length} tokens is too short to window texts")

    def split(self, texts: list[str]) -> Split:
        pieces: list[str] = []
        owner: list[int] = []  # the text each piece comes from
        weight: list[int] = []  # its tokens: the weight of its embedding in the text's mean
        windowed = 0
        with _quiet("transformers"):  # it warns that long texts exceed the model: that is why they are split
            encodings = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
        for i, (text, ids, offsets) in enumerate(zip(texts, encodings["input_ids"], encodings["offset_mapping"])):
            if len(ids) <= self.limit:
                bounds = [(text, max(len(ids), 1))]
            else:
                windowed += 1
                bounds = [
                    (text[offsets[start][0] : offsets[end - 1][1]], end - start) for start, end in self._bounds(offsets)
                ]
            for piece, tokens in bounds:
                pieces.append(piece)
                owner.append(i)
                weight.append(tokens)
        return Split(pieces, np.array(owner, np.int64), np.array(weight, np.float64), windowed)

    def _bounds(self, offsets) -> list[tuple[int, int]]:
        """[start, end) token ranges of at most ``limit`` tokens, ending where a word ends when it can."""
        bounds, start, n = [], 0, len(offsets)
        while start < n:
            end = min(start + self.limit, n)
            # a token glued to the next one (no space between) continues a word: back off to a word's end
            cut = end
            while n > cut > start + self.limit // 2 and offsets[cut][0] == offsets[cut - 1][1]:
                cut -= 1
            end = cut if cut > start + self.limit // 2 else end
            bounds.append((start, end))
            start = end
        return bounds


@contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def length_batches(texts: list[str], batch_size: int) -> list[np.ndarray]:
    """Row numbers of each batch: texts longest first, ``batch_size`` at a time (as
    sentence-transformers batches, so padding stays short). A text's embedding depends in its
    last bits on its batch's padding, so every path, one process or Ray workers, embeds these batches."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
