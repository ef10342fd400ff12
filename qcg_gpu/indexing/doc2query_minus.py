"""Extended Doc2Query-- (METHOD.md, index step 3): keep each chunk's pairs closest to it."""

from __future__ import annotations

import math

import numpy as np


def keep_count(alpha: float, m: int) -> int:
    """ceil(alpha * m), immune to float noise (0.7 * 10 is 7.000000000000001 in binary floating point)."""
    return math.ceil(round(alpha * m, 9))


def keep_mask(chunk_ids: np.ndarray, gen_index: np.ndarray, scores: np.ndarray, alpha: float) -> np.ndarray:
    """Boolean mask: per chunk, its top ceil(alpha * m_i) pairs by score (ties by lower gen_index).

    ``m_i`` is the number of valid pairs of chunk i, i.e. its rows here.
    """
    n = len(chunk_ids)
    if n == 0:
        return np.zeros(0, dtype=bool)
    order = np.lexsort((gen_index, -scores.astype(np.float64), chunk_ids))  # by chunk, best first
    sorted_chunks = chunk_ids[order]
    group_start = np.r_[0, np.flatnonzero(np.diff(sorted_chunks)) + 1]
    group_size = np.diff(np.r_[group_start, n])
    rank = np.arange(n) - np.repeat(group_start, group_size)
    quota = np.array([keep_count(alpha, int(m)) for m in group_size])
    mask = np.zeros(n, dtype=bool)
    mask[order] = rank < np.repeat(quota, group_size)
    return mask
