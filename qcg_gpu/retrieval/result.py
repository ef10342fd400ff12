"""What every retrieval backend shares: the query check, the seed threshold, the result type
and the size of a similarity tile."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import RetrievalConfig
from ..errors import QCGError

SIMILARITY_TILE_ELEMENTS = 1 << 26  # 256 MiB of float32 similarities per query tile


@dataclass
class RetrievalResult:
    chunk_ids: np.ndarray  # (B, K) int64, -1 where a query has fewer than K chunks; K = top_k, at most the chunks
    scores: np.ndarray  # (B, K) float32 mean similarity, -inf where chunk_ids is -1
    seed_ids: np.ndarray  # (B, n) int64, -1 padded, best first; n at most the nodes
    seed_sims: np.ndarray  # (B, n) float32
    n_selected: np.ndarray  # (B,) size of Q* per query

    @classmethod
    def empty(cls, b: int, config: RetrievalConfig) -> RetrievalResult:
        """B queries with no chunk and no seed, to be filled in."""
        return cls(
            np.full((b, config.top_k), -1, np.int64),
            np.full((b, config.top_k), -np.inf, np.float32),
            np.full((b, config.n), -1, np.int64),
            np.full((b, config.n), -np.inf, np.float32),
            np.zeros(b, np.int64),
        )

    @classmethod
    def concatenate(cls, parts: list[RetrievalResult]) -> RetrievalResult:
        """The results of consecutive query blocks as one."""
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in cls.__dataclass_fields__))


def check_queries(queries: np.ndarray, dim: int) -> np.ndarray:
    """Queries as a contiguous float32 (B, dim) array of unit rows; refuses what cannot be fixed."""
    q = np.asarray(queries, dtype=np.float32)
    if q.ndim == 1:
        q = q[None, :]
    if q.ndim != 2 or q.shape[1] != dim:
        raise QCGError(
            f"query embeddings must have shape (B, {dim}) to match the index, got {tuple(np.shape(queries))}"
        )
    norms = np.sqrt(np.einsum("ij,ij->i", q, q))[:, None]  # one pass; NaN or inf in a row makes its norm non-finite
    if not np.isfinite(norms).all():
        if not np.isfinite(q).all():
            raise QCGError("query embeddings contain NaN or infinite values")
        norms = np.linalg.norm(q.astype(np.float64), axis=1, keepdims=True).astype(np.float32)  # huge but finite
    if (norms == 0).any():
        raise QCGError("a query embedding is all zeros")
    return np.ascontiguousarray(q / norms if not np.allclose(norms, 1.0, atol=1e-3) else q)


def seed_threshold(gamma: float) -> np.float32:
    """sim + 1 >= gamma as a float32 bound on sim: the smallest float32 >= gamma - 1, so every backend agrees."""
    t = np.float32(gamma - 1.0)
    return t if float(t) >= gamma - 1.0 else np.nextafter(t, np.float32(np.inf))


def tile_rows(n_nodes: int, max_rows: int = 256, budget: int = SIMILARITY_TILE_ELEMENTS) -> int:
    """Queries per similarity tile: at most max_rows (256: the fastest for CPU BLAS at N = 100k when
    chosen) and at most ``budget`` similarities."""
    return int(max(1, min(max_rows, budget // max(n_nodes, 1))))
