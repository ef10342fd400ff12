"""Sentence embeddings, l2-normalised, batched, on the GPU when there is one.

A text's embedding depends on the text only, never on the batch it shares: every batch has
``batch_size`` rows (the last one filled up with copies) padded to a fixed length chosen from
the text's own token count (16, 32, ..., the model's limit). A GEMM rounds the same way for the
same shapes, so a build, an ``--add`` and a Ray worker give every text the same bits, and the kNN
graph does not change with how the texts were batched. Where MKL's own kernels run (AVX2), the
thread count would change the rounding too: capabilities.MKL_REPRODUCIBLE keeps it from doing so.

Texts longer than the embedder's limit (256 word pieces for all-MiniLM-L6-v2) would be cut
silently by the model; by default they are embedded whole instead: split into windows of
at most the limit, each window embedded, and the windows' embeddings averaged (weighted by
their token counts) and normalised (``long_texts="mean"``). ``"truncate"`` keeps the model's
own cut, as the paper's setup did.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .capabilities import check_device, default_device, require
from .errors import QCGError
from .log import errors_only, progress_bar, show_progress
from .models import DEFAULT_EMBEDDER, resolve_model

LONG_TEXT_MODES = ("mean", "truncate")
# Rows per batch. Small enough that a few leftover texts of one padded length do not pay for a full
# batch of copies, large enough to keep the GEMMs efficient (per-row rates within 10% of 128 rows on
# a 2-core Xeon; see benchmarks/RESULTS.md).
BATCH_SIZE = 32


class Embedder:
    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        batch_size: int = BATCH_SIZE,
        long_texts: str = "mean",
    ):
        if long_texts not in LONG_TEXT_MODES:
            raise QCGError(f"long_texts must be one of {', '.join(LONG_TEXT_MODES)}, got {long_texts!r}")
        path, self.model_name = resolve_model(model, DEFAULT_EMBEDDER)
        sentence_transformers = require("sentence_transformers")
        self.device = check_device(device, "the embedding device") if device else default_device()
        self.batch_size = batch_size
        try:
            with _model_loading_bar(show_progress()):
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
        if not texts:
            return out
        batches = shape_batches(self.token_counts(texts), self.batch_size, self.max_tokens)
        for rows, length in progress_bar(batches, desc=desc, unit="batch"):
            out[rows] = self.encode_batch([texts[i] for i in rows], length)
        return out

    def token_counts(self, texts: list[str]) -> np.ndarray:
        return token_counts(self.model.tokenizer, texts, self.max_tokens)

    def encode_batch(self, texts: list[str], length: int) -> np.ndarray:
        """One batch of at most ``batch_size`` texts, run as ``batch_size`` rows padded to ``length`` tokens."""
        torch = require("torch")
        rows = texts + [texts[0]] * (self.batch_size - len(texts))  # fixed shapes: see the module's docstring
        features = self.model.preprocess(
            rows, processing_kwargs={"text": {"padding": "max_length", "max_length": length}}
        )
        features = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
        with torch.inference_mode():
            vectors = self.model.forward(features)["sentence_embedding"][: len(texts)]
            vectors = torch.nn.functional.normalize(vectors.float(), dim=1)
        return vectors.cpu().numpy()


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
        """One unit vector per text: the token-weighted mean of its pieces' vectors, normalised
        (a text of one piece keeps its vector as it is, whatever texts it came with)."""
        pooled = np.zeros((n_texts, vectors.shape[1]), dtype=np.float64)
        np.add.at(pooled, self.owner, vectors * self.weight[:, None])
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        out = pooled.astype(np.float32)
        whole = np.bincount(self.owner, minlength=n_texts) == 1
        out[self.owner[whole[self.owner]]] = vectors[whole[self.owner]]
        return out


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
        with errors_only("transformers"):  # it warns that long texts exceed the model: that is why they are split
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


def token_counts(tokenizer, texts: list[str], max_tokens: int) -> np.ndarray:
    """Tokens of each text as the model sees it (special tokens included, cut at its limit)."""
    with errors_only("transformers"):
        ids = tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
    return np.array([len(i) for i in ids], dtype=np.int64)


SHAPE_LENGTHS = (16, 32, 64, 128, 256, 512)  # padded lengths a batch may have (and the model's limit)


def shape_batches(token_counts: np.ndarray, batch_size: int, max_tokens: int) -> list[tuple[np.ndarray, int]]:
    """(row numbers, padded length) of each batch: the texts grouped by the shortest padded length
    that holds them, ``batch_size`` at a time, longest group first."""
    lengths = sorted({min(n, max_tokens) for n in SHAPE_LENGTHS} | {max_tokens})
    padded = np.array([next(n for n in lengths if n >= min(c, max_tokens)) for c in token_counts], dtype=np.int64)
    batches = []
    for length in sorted(set(padded.tolist()), reverse=True):
        rows = np.flatnonzero(padded == length)
        batches += [(rows[start : start + batch_size], length) for start in range(0, len(rows), batch_size)]
    return batches


@contextmanager
def _model_loading_bar(shown: bool):
    """transformers' "Loading weights" bar, shown only where qcg shows its own (not under --quiet)."""
    from transformers.utils import logging as transformers_logging

    was = transformers_logging.is_progress_bar_enabled()
    if not shown:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not shown:
            transformers_logging.enable_progress_bar()
