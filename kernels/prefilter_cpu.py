"""Exact seed selection from a bf16 similarity prefilter, on CPU (METHOD.md, retrieval step 2).

A bf16 GEMM (AMX on recent Xeons) runs 5-8x faster than float32, but each similarity it gives
may be off by up to ``eps`` (a bound computed from the vectors' actual rounding, see
``qcg_gpu.retrieval.bf16_error_bound``). Seeds stay exact with two passes:

1. ``scan_block`` reads the bf16 tile once and keeps, per query, every node whose approximate
   similarity ``a`` could still make the exact top n above the threshold ``t``:
   ``a >= max(t, a_n - eps) - eps``, where ``a_n`` is the n-th best approximation seen so far
   (n nodes with ``a >= a_n`` all have exact similarity ``>= a_n - eps``, so the n-th best exact
   one does too). Blocks of 64 columns are skipped on one vectorised max; few entries pass.
2. ``rescore`` computes the exact similarity of the kept candidates (float64 dot products of the
   float32 vectors) and selects the best n with ``sim >= t``, ties by lower node id.

A query whose candidates overflow the buffer (thousands of near-ties) is flagged; the caller
selects its seeds with the float32 path instead.

bf16 values arrive as their int16 bit patterns (numba has no bf16 type); ``sortable`` maps them
to integers that order like the values, and ``VALUES[key + 32768]`` is the value of a key.
"""
from __future__ import annotations

import numba
import numpy as np

from .prefetch_cpu import prefetch_row

BLOCK, SUB_BLOCK = 128, 32  # columns checked at once against the floor; a block that passes, in sub-blocks


def _bf16_values_by_key() -> np.ndarray:
    """float32 value of every sortable bf16 key -32768..32767, NaNs replaced by -inf/+inf at the ends."""
    keys = np.arange(-32768, 32768, dtype=np.int32)
    bits = np.where(keys >= 0, keys, keys ^ 0x7FFF) & 0xFFFF  # the map is its own inverse
    values = (bits.astype(np.uint32) << 16).view(np.float32).copy()
    values[np.isnan(values) & (keys < 0)] = -np.inf
    values[np.isnan(values) & (keys >= 0)] = np.inf
    return values


VALUES = _bf16_values_by_key()


@numba.njit(inline="always")
def sortable(bits):
    """bf16 bit pattern (int16) -> an int16 that orders like the bf16 value."""
    return np.int16(bits ^ ((bits >> 15) & 0x7FFF))


@numba.njit(inline="always")
def _key_floor(floor, values):
    """The largest key whose value is below ``floor``: keys above it are the ones to keep (<= 1 bf16 step of slack)."""
    return np.int16(np.searchsorted(values, floor) - 32768 - 1)


@numba.njit(inline="always")
def _block_max(flat, start, length):
    """Largest key of flat[start : start + length]."""
    m = np.int16(-32768)
    base = np.uint64(start)
    for j in range(length):  # unsigned indices: no wraparound check, so LLVM vectorises
        m = max(m, sortable(flat[base + np.uint64(j)]))
    return m


@numba.njit(parallel=True, cache=True)
def scan_block(bits, col0, t_minus_eps, eps, n, cand_ids, cand_vals, counts, best, overflow, values):
    """One (rows, cols) bf16 tile whose column 0 is node ``col0``; updates each row's candidates
    (``cand_ids/cand_vals/counts``), its n best approximations ``best`` (descending) and ``overflow``."""
    rows, cols = bits.shape
    flat = bits.ravel()  # C-contiguous: a view
    capacity = cand_ids.shape[1]
    for r in numba.prange(rows):
        if overflow[r]:
            continue
        ids, vals, top = cand_ids[r], cand_vals[r], best[r]
        floor = max(t_minus_eps[r], top[n - 1] - 2 * eps[r])
        key_floor = _key_floor(floor, values)
        count = counts[r]
        for start in range(0, cols, BLOCK):
            if _block_max(flat, r * cols + start, min(BLOCK, cols - start)) <= key_floor:
                continue  # most blocks end here
            for sub in range(start, min(start + BLOCK, cols), SUB_BLOCK):
                stop = min(sub + SUB_BLOCK, cols)
                if _block_max(flat, r * cols + sub, stop - sub) <= key_floor:
                    continue
                for j in range(sub, stop):
                    key = sortable(flat[r * cols + j])
                    if key <= key_floor:
                        continue
                    v = values[np.int32(key) + 32768]
                    if v < floor:
                        continue
                    if count == capacity:  # drop what the risen floor excludes; give up on a row of near-ties
                        kept = 0
                        for i in range(count):
                            if vals[i] >= floor:
                                ids[kept], vals[kept] = ids[i], vals[i]
                                kept += 1
                        count = kept
                        if count > capacity - capacity // 4:
                            overflow[r] = True
                            break
                    ids[count], vals[count] = col0 + j, v
                    count += 1
                    if v > top[n - 1]:  # a new n-best approximation: insert it and raise the floor
                        pos = n - 1
                        while pos > 0 and top[pos - 1] < v:
                            top[pos] = top[pos - 1]
                            pos -= 1
                        top[pos] = v
                        new_floor = max(t_minus_eps[r], top[n - 1] - 2 * eps[r])
                        if new_floor > floor:
                            floor, key_floor = new_floor, _key_floor(new_floor, values)
                if overflow[r]:
                    break
            if overflow[r]:
                break
        counts[r] = count


@numba.njit(inline="always")
def _next_candidate(vals, count, floor, i):
    """Position of the first candidate at or after ``i`` that the final floor keeps (``count`` if none)."""
    while i < count and vals[i] < floor:
        i += 1
    return i


# reassoc vectorises the float64 dot products (their order changes results by ~1e-16, far below float32)
@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rescore(queries, nodes, threshold, eps, n, cand_ids, cand_vals, counts, best, overflow):
    """Exact seeds of each non-overflowed row: the n best candidates with sim >= threshold, ties by lower id."""
    rows = queries.shape[0]
    dim = nodes.shape[1]
    ids = np.full((rows, n), -1, dtype=np.int64)
    exact = np.full((rows, n), -np.inf, dtype=np.float64)  # ranked in float64: float32 rounding makes no ties
    for r in numba.prange(rows):
        if overflow[r]:
            continue
        floor = max(threshold - eps[r], best[r, n - 1] - 2 * eps[r])
        q, vals, count = queries[r].astype(np.float64), cand_vals[r], counts[r]
        i = _next_candidate(vals, count, floor, 0)
        while i < count:
            u = cand_ids[r, i]
            i = _next_candidate(vals, count, floor, i + 1)
            if i < count:
                prefetch_row(nodes, cand_ids[r, i])  # its row loads while this one is summed
            v = 0.0
            for d in range(dim):
                v += q[d] * np.float64(nodes[u, d])
            if v < threshold:
                continue
            pos = n
            while pos > 0 and (v > exact[r, pos - 1] or (v == exact[r, pos - 1] and u < ids[r, pos - 1])):
                pos -= 1
            if pos < n:
                for j in range(n - 1, pos, -1):
                    exact[r, j], ids[r, j] = exact[r, j - 1], ids[r, j - 1]
                exact[r, pos], ids[r, pos] = v, u
    return ids, exact.astype(np.float32)


@numba.njit(parallel=True, cache=True)
def rounding_norms(queries, rounded_bits, values):
    """float64 norms |q|, |q~| and |q - q~| per row, q~ the bf16 rounding of q given as bit patterns
    (``values`` = ``VALUES``): the query side of ``qcg_gpu.retrieval.bound_from_norms``."""
    rows, dim = queries.shape
    q_norm, rounded_norm, residual_norm = np.empty(rows), np.empty(rows), np.empty(rows)
    for r in numba.prange(rows):
        qq = rr = dd = 0.0
        for d in range(dim):
            q = np.float64(queries[r, d])
            x = np.float64(values[np.int32(sortable(rounded_bits[r, d])) + 32768])
            qq += q * q
            rr += x * x
            dd += (q - x) * (q - x)
        q_norm[r], rounded_norm[r], residual_norm[r] = np.sqrt(qq), np.sqrt(rr), np.sqrt(dd)
    return q_norm, rounded_norm, residual_norm
