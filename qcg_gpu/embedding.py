"""Sentence embeddings, l2-normalised, batched, on the GPU when there is one."""
from __future__ import annotations

import numpy as np

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
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=progress,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)
