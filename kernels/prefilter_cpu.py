"""Exact seed selection from a bf16 similarity prefilter, on CPU (METHOD.md, retrieval step 2).

A bf16 GEMM (AMX on recent Xeons) runs 5-8x faster than float32, but each similarity it gives
may be off by up to ``eps`` (a bound computed from the vectors' actual rounding, see
``qcg_gpu.retrieval.bf16_error_bound``). Seeds stay exact with two passes:

1. ``scan_block`` reads the bf16 tile once and keeps, per query, every node whose approximate
   similarity ``a`` could still make the exact top n above the threshold ``t``:
   ``a >= max(t, a_n - eps) - eps``, where ``a_n`` is the n-th best approximation seen so far
   (n nodes with ``a >= a_n`` all have exact similarity ``>= a_n - eps``, so the n-th best exact
   one does too). Blocks of ``BLOCK`` columns are skipped on one vectorised max; few entries pass.
2. ``rescore_and_rank`` computes the exact similarity of the kept candidates (float64 dot products
   of the float32 vectors), selects the best n with ``sim >= t``, ties by lower node id, and goes
   on with that query's expansion and chunk ranking while its seeds' rows are in cache.

A query whose candidates overflow the buffer (thousands of near-ties) is flagged; the caller
selects its seeds with the float32 path instead.

bf16 values arrive as their int16 bit patterns (numba has no bf16 type); ``sortable`` maps them
to integers that order like the values, and ``VALUES[key + 32768]`` is the value of a key.
"""

from __future__ import annotations

import numba
import numpy as np

from .expand_cpu import new_scratch, rank_query
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
def _prefetch_candidates(nodes, cand_ids, cand_vals, count, floor):
    """Ask for the rows of a query's candidates that the final floor keeps, ahead of rescoring them."""
    for i in range(count):
        if cand_vals[i] >= floor:
            prefetch_row(nodes, cand_ids[i])


@numba.njit(inline="always")
def _rescore_query(query, nodes, threshold, floor, cand_ids, cand_vals, count, ids_out, sims_out):
    """The exact seeds of one query: its best candidates with sim >= threshold, ties by lower id,
    into ``ids_out``/``sims_out`` (n = their length; -1/-inf filled). Ranked in float64, where
    float32 rounding makes no ties."""
    n = len(ids_out)
    q = query.astype(np.float64)
    for i in range(count):
        if cand_vals[i] < floor:
            continue
        u = cand_ids[i]
        v = 0.0
        for d in range(nodes.shape[1]):
            v += q[d] * np.float64(nodes[u, d])
        if v < threshold:
            continue
        pos = n
        while pos > 0 and (v > sims_out[pos - 1] or (v == sims_out[pos - 1] and u < ids_out[pos - 1])):
            pos -= 1
        if pos < n:
            for j in range(n - 1, pos, -1):
                sims_out[j], ids_out[j] = sims_out[j - 1], ids_out[j - 1]
            sims_out[pos], ids_out[pos] = v, u


# reassoc vectorises the dot products (float64 ones change by ~1e-16, far below float32; float32 ones
# in the last bits, as between any two BLAS builds)
@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rescore_and_rank(
    queries,
    nodes,
    threshold,
    eps,
    n,
    cand_ids,
    cand_vals,
    counts,
    best,
    overflow,
    indptr,
    indices,
    node_chunk,
    n_chunks,
    hops,
    top_k,
    n_threads,
):
    """Exact seeds of each non-overflowed row, then its expansion and top-K chunks (``expand_cpu.rank_query``),
    one query after the other: the seeds' rows are still in cache when the expansion scores them, and the
    next query's candidate rows load meanwhile. Returns seed ids and sims (best first) and the chunks,
    scores and |Q*| of ``expand_and_rank``; overflowed rows stay empty (-1)."""
    rows = queries.shape[0]
    seed_ids = np.full((rows, n), -1, dtype=np.int64)
    seed_sims = np.full((rows, n), -np.inf, dtype=np.float64)
    out_chunks = np.full((rows, top_k), -1, dtype=np.int64)
    out_scores = np.full((rows, top_k), -np.inf, dtype=np.float32)
    out_selected = np.zeros(rows, dtype=np.int64)
    floors = np.empty(rows, dtype=np.float32)
    for r in range(rows):  # a candidate must reach its row's final floor (see the module docstring)
        floors[r] = max(threshold - eps[r], best[r, n - 1] - 2 * eps[r])
    for t in numba.prange(n_threads):
        scratch = new_scratch(nodes.shape[0], n_chunks)
        for r in range(t, rows, n_threads):
            if r + n_threads < rows and not overflow[r + n_threads]:
                following = r + n_threads
                _prefetch_candidates(
                    nodes, cand_ids[following], cand_vals[following], counts[following], floors[following]
                )
            if overflow[r]:
                continue
            _rescore_query(
                queries[r], nodes, threshold, floors[r], cand_ids[r], cand_vals[r], counts[r], seed_ids[r], seed_sims[r]
            )
            out_selected[r] = rank_query(
                np.int32(r + 1),
                seed_ids[r],
                queries[r],
                indptr,
                indices,
                nodes,
                node_chunk,
                hops,
                scratch,
                out_chunks[r],
                out_scores[r],
            )
    return seed_ids, seed_sims.astype(np.float32), out_chunks, out_scores, out_selected


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rounding_norms(queries, rounded):
    """float64 norms |q|, |q~| and |q - q~| per row, q~ = ``rounded``, the bf16 rounding of q (as float32):
    the query side of ``qcg_gpu.retrieval.bound_from_norms``."""
    rows, dim = queries.shape
    q_norm, rounded_norm, residual_norm = np.empty(rows), np.empty(rows), np.empty(rows)
    for r in numba.prange(rows):
        qq = rr = dd = 0.0
        for d in range(dim):
            q, x = np.float64(queries[r, d]), np.float64(rounded[r, d])
            qq += q * q
            rr += x * x
            dd += (q - x) * (q - x)
        q_norm[r], rounded_norm[r], residual_norm[r] = np.sqrt(qq), np.sqrt(rr), np.sqrt(dd)
    return q_norm, rounded_norm, residual_norm
