"""Sentence embeddings, l2-normalised, batched, on the GPU when there is one."""
from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from .capabilities import default_device, require
from .errors import QCGError
from .models import DEFAULT_EMBEDDER, resolve_model


class Embedder:
    def __init__(self, model: str | None = None, device: str | None = None, batch_size: int = 128):
        path, self.model_name = resolve_model(model, DEFAULT_EMBEDDER)
        sentence_transformers = require("sentence_transformers")
        self.device = device or default_device()
        self.batch_size = batch_size
        try:
            self.model = sentence_transformers.SentenceTransformer(path, device=self.device)
        except Exception as exc:
            raise QCGError(f"cannot load embedder {self.model_name!r}: {exc}") from exc
        self.dim = self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension") else self.model.get_sentence_embedding_dimension()

    def encode(self, texts: list[str], progress: bool = False, desc: str = "embed") -> np.ndarray:
        """float32 array (len(texts), dim), each row of unit length."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for rows in tqdm(length_batches(texts, self.batch_size), desc=desc, unit="batch", disable=not progress):
            out[rows] = self.encode_batch([texts[i] for i in rows])
        return out

    def encode_batch(self, texts: list[str]) -> np.ndarray:
        """One batch through the model, padded to its longest text."""
        vectors = self.model.encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True)
        return np.asarray(vectors, dtype=np.float32)


def length_batches(texts: list[str], batch_size: int) -> list[np.ndarray]:
    """Row numbers of each batch: texts longest first, ``batch_size`` at a time (as
    sentence-transformers batches, so padding stays short). A text's embedding depends in its
    last bits on its batch's padding, so every path, one process or Ray workers, embeds these batches."""
    order = np.argsort([-len(t) for t in texts], kind="stable")
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
