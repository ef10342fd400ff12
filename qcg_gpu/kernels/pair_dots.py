"""Exact similarities of (row, column) pairs for the kNN graph's ranking (METHOD.md, index step 4):
``out[p] = a[rows[p]] . b[cols[p]]`` in float64, without writing the gathered rows out first.

Every kNN path (one process, shard by shard, IVF list by list, updates) ranks by these numbers, so a
pair's score must not depend on the batch it came in: :func:`exact_dot` sums one pair in one thread,
in four accumulators over the columns (j mod 4) added as (s0 + s1) + (s2 + s3), then the tail. numba
compiles it without fast-math, so the order is kept.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def exact_dot(x, y) -> float:
    """x . y in float64 (float32 inputs), summed in the one fixed order every kNN path uses."""
    dim = x.shape[0]
    body = dim - dim % 4
    s0 = s1 = s2 = s3 = 0.0
    for j in range(0, body, 4):
        s0 += np.float64(x[j]) * np.float64(y[j])
        s1 += np.float64(x[j + 1]) * np.float64(y[j + 1])
        s2 += np.float64(x[j + 2]) * np.float64(y[j + 2])
        s3 += np.float64(x[j + 3]) * np.float64(y[j + 3])
    total = (s0 + s1) + (s2 + s3)
    for j in range(body, dim):
        total += np.float64(x[j]) * np.float64(y[j])
    return total


@numba.njit(parallel=True, cache=True)
def pair_dots(a, b, rows, cols):
    out = np.empty(len(rows), dtype=np.float64)
    for p in numba.prange(len(rows)):
        out[p] = exact_dot(a[rows[p]], b[cols[p]])
    return out
