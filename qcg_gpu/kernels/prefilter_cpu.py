"""Exact seed selection from a low-precision similarity prefilter, on CPU (METHOD.md, retrieval step 2).

A bf16 GEMM (AMX on recent Xeons) and an int8 one (VNNI; about 2x on AVX2 alone) run faster than float32
(benchmarks/RESULTS.md, *Retrieval throughput*), but
each similarity it gives may be off by up to ``eps`` (a bound computed from the vectors' actual
rounding, see ``qcg_gpu.retrieval.bounds``). Seeds stay exact with two passes:

1. ``scan_block`` reads the approximate tile once and keeps, per query, every node whose approximate
   similarity ``a`` could still make the exact top n above the threshold ``t``:
   ``a >= max(t, a_n - eps) - eps``, where ``a_n`` is the n-th best approximation seen so far
   (n nodes with ``a >= a_n`` all have exact similarity ``>= a_n - eps``, so the n-th best exact
   one does too). Blocks of ``BLOCK`` columns are skipped on one vectorised max; few entries pass.
2. ``rescore_and_rank`` computes the exact similarity of the kept candidates (float64 dot products
   of the float32 vectors), selects the best n with ``sim >= t``, ties by lower node id, and goes
   on with that query's expansion and chunk ranking while its seeds' rows are in cache.

A query whose candidates overflow the buffer (thousands of near-ties) is flagged; the caller
selects its seeds with ``rescore_all_and_rank``, the same float64 rescoring over every node. So every
precision, and the fallback, ranks seeds by the same numbers: float64 dot products of the stored
float32 vectors, summed in one order (``_dot64``), their float32 rounding returned as similarities.

The scan compares *keys* that order like the approximations, one type per precision:
- a float32 GEMM's values are their own keys (the float32 "prefilter": its bound is the float32
  rounding, ~d 2^-24, so few candidates pass, and its seeds rank by the same float64 numbers);
- bf16 values arrive as their int16 bit patterns (numba has no bf16 type); ``sortable`` maps them
  to integers that order like the values, and ``VALUES[key + 32768]`` is the value of a key;
- an int8 GEMM gives exact dot products of the quantised vectors, as int32 (``torch._int_mm``) or as
  float32 (oneDNN's matmul primitive; integers below 2^24, so exact); the value of a key is
  ``key * unit`` with ``unit`` = 1 / (query scale x node scale), one per query. A float32 GEMM's
  ``unit`` is 1, which leaves its values as they are.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import overload

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


def key_of(raw):
    """The key of one GEMM output: bf16 bits (int16) -> ``sortable``; int32 and float32 -> itself."""
    raise NotImplementedError  # numba only (the overload below)


def key_value(key, unit, values):
    """The approximate similarity of a key."""
    raise NotImplementedError


def key_floor(floor, unit, values, key):
    """A key at or below every key whose value reaches ``floor`` (keys above it are the ones to
    look at; <= 1 bf16 step or integer of slack). ``key`` only gives the key type."""
    raise NotImplementedError


@overload(key_of, inline="always")
def _key_of(raw):
    if isinstance(raw, types.Integer) and raw.bitwidth == 16:
        return lambda raw: sortable(raw)
    return lambda raw: raw


@overload(key_value, inline="always")
def _key_value(key, unit, values):
    if key.bitwidth == 16 and isinstance(key, types.Integer):
        return lambda key, unit, values: values[np.int32(key) + 32768]
    return lambda key, unit, values: np.float32(key) * unit  # exact for a float32 GEMM's unit of 1


@overload(key_floor, inline="always")
def _key_floor(floor, unit, values, key):
    if isinstance(key, types.Float):
        # key * unit is rounded once, by at most 2^-24 of it: floor / unit, less 16 times that
        def float_floor(floor, unit, values, key):
            at = np.float64(floor) / np.float64(unit)
            return np.float32(at - (1.0 + abs(at)) * 2.0**-20)

        return float_floor
    if key.bitwidth == 16:
        return lambda floor, unit, values, key: np.int16(np.searchsorted(values, floor) - 32768 - 1)

    def integer_floor(floor, unit, values, key):
        # a key's value is float32(key) * unit, rounded: one integer below floor / unit covers the rounding
        below = np.floor(np.float64(floor) / np.float64(unit)) - 1.0
        return np.int32(min(max(below, -(2.0**31)), 2.0**31 - 1))

    return integer_floor


@numba.njit(inline="always")
def _block_max(flat, start, length):
    """Largest key of flat[start : start + length] (length >= 1)."""
    base = np.uint64(start)
    m = key_of(flat[base])
    for j in range(1, length):  # unsigned indices: no wraparound check, so LLVM vectorises
        m = max(m, key_of(flat[base + np.uint64(j)]))
    return m


@numba.njit(parallel=True, cache=True)
def scan_block(approx, col0, bounds, n, candidates, values):
    """One (rows, cols) tile of approximate similarities (bf16 bits or int8 dot products, see the
    module docstring) whose column 0 is node ``col0``, each row within its :class:`RowBounds`; updates
    each row's :class:`Candidates` (ids, values, count, its n best approximations, overflow)."""
    rows, cols = approx.shape
    flat = approx.ravel()  # C-contiguous: a view
    t_minus_eps, eps, unit = bounds.t_minus_eps, bounds.eps, bounds.unit
    cand_ids, cand_vals, best, overflow = candidates.ids, candidates.vals, candidates.best, candidates.overflow
    counts = candidates.counts  # on its own: unpacked with the others, its writes were lost (numba 0.65, prange)
    capacity = cand_ids.shape[1]
    for r in numba.prange(rows):
        if overflow[r]:
            continue
        ids, vals, top = cand_ids[r], cand_vals[r], best[r]
        floor = max(t_minus_eps[r], top[n - 1] - 2 * eps[r])
        lowest = key_floor(floor, unit[r], values, flat[0])
        count = counts[r]
        for start in range(0, cols, BLOCK):
            if _block_max(flat, r * cols + start, min(BLOCK, cols - start)) <= lowest:
                continue  # most blocks end here
            for sub in range(start, min(start + BLOCK, cols), SUB_BLOCK):
                stop = min(sub + SUB_BLOCK, cols)
                if _block_max(flat, r * cols + sub, stop - sub) <= lowest:
                    continue
                for j in range(sub, stop):
                    key = key_of(flat[r * cols + j])
                    if key <= lowest:
                        continue
                    v = key_value(key, unit[r], values)
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
                            floor, lowest = new_floor, key_floor(new_floor, unit[r], values, flat[0])
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
def _dot64(q, nodes, u):
    """The exact similarity every path ranks seeds by: the float64 dot product of a query (float64)
    and node ``u`` (float32), in this one summation order."""
    v = 0.0
    for d in range(nodes.shape[1]):
        v += q[d] * np.float64(nodes[u, d])
    return v


@numba.njit(inline="always")
def _insert_seed(v, u, ids_out, sims_out):
    """Node ``u`` of similarity ``v`` into the best-first seeds (ties by lower id), if it ranks."""
    n = len(ids_out)
    pos = n
    while pos > 0 and (v > sims_out[pos - 1] or (v == sims_out[pos - 1] and u < ids_out[pos - 1])):
        pos -= 1
    if pos < n:
        for j in range(n - 1, pos, -1):
            sims_out[j], ids_out[j] = sims_out[j - 1], ids_out[j - 1]
        sims_out[pos], ids_out[pos] = v, u


@numba.njit(inline="always")
def _rescore_query(query, nodes, threshold, floor, cand_ids, cand_vals, count, seeds_out):
    """The exact seeds of one query: its best candidates with sim >= threshold, ties by lower id,
    into ``seeds_out`` = (ids, sims) (n = their length; -1/-inf filled). Ranked in float64, where
    float32 rounding makes no ties."""
    ids_out, sims_out = seeds_out
    q = query.astype(np.float64)
    for i in range(count):
        if cand_vals[i] < floor:
            continue
        v = _dot64(q, nodes, cand_ids[i])
        if v >= threshold:
            _insert_seed(v, cand_ids[i], ids_out, sims_out)


@numba.njit(inline="always")
def _new_outputs(rows, n, top_k):
    """Seed ids and float64 sims (rows, n), then chunks, scores (rows, top_k) and |Q*| per row: -1/-inf/0 filled."""
    return (
        np.full((rows, n), -1, dtype=np.int64),
        np.full((rows, n), -np.inf, dtype=np.float64),
        np.full((rows, top_k), -1, dtype=np.int64),
        np.full((rows, top_k), -np.inf, dtype=np.float32),
        np.zeros(rows, dtype=np.int64),
    )


# reassoc vectorises the dot products (float64 ones change by ~1e-16, far below float32; float32 ones
# in the last bits, as between any two BLAS builds)
@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rescore_and_rank(queries, nodes, threshold, eps, n, candidates, graph, ranking):
    """Exact seeds of each non-overflowed row of ``candidates``, then its expansion and top-K chunks
    (``expand_cpu.rank_query`` over ``graph``, as ``ranking`` says), one query after the other: the seeds'
    rows are still in cache when the expansion scores them, and the next query's candidate rows load
    meanwhile. Returns seed ids and their float64 sims (best first: what they rank by, so that seeds of
    node shards merge exactly), top-K chunks, scores and |Q*| per row; overflowed rows stay empty (-1)."""
    rows, n_threads = queries.shape[0], ranking.n_threads
    cand_ids, cand_vals, best, overflow = candidates.ids, candidates.vals, candidates.best, candidates.overflow
    counts = candidates.counts
    seed_ids, seed_sims, out_chunks, out_scores, out_selected = _new_outputs(rows, n, ranking.top_k)
    floors = np.empty(rows, dtype=np.float32)
    for r in range(rows):  # a candidate must reach its row's final floor (see the module docstring)
        floors[r] = max(threshold - eps[r], best[r, n - 1] - 2 * eps[r])
    for t in numba.prange(n_threads):
        scratch = new_scratch(nodes.shape[0], graph.n_chunks)
        for r in range(t, rows, n_threads):
            if r + n_threads < rows and not overflow[r + n_threads]:
                following = r + n_threads
                _prefetch_candidates(
                    nodes, cand_ids[following], cand_vals[following], counts[following], floors[following]
                )
            if overflow[r]:
                continue
            seeds = (seed_ids[r], seed_sims[r])
            _rescore_query(queries[r], nodes, threshold, floors[r], cand_ids[r], cand_vals[r], counts[r], seeds)
            out = (out_chunks[r], out_scores[r])
            out_selected[r] = rank_query(
                np.int32(r + 1), seed_ids[r], queries[r], nodes, graph, ranking.hops, scratch, out
            )
    return seed_ids, seed_sims, out_chunks, out_scores, out_selected


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rescore_all_and_rank(queries, nodes, threshold, n, graph, ranking):
    """``rescore_and_rank`` with every node a candidate: the rows whose near-ties overflowed the
    candidate buffer, ranked by the same float64 numbers (no (rows, N) similarity matrix)."""
    rows, n_threads = queries.shape[0], ranking.n_threads
    seed_ids, seed_sims, out_chunks, out_scores, out_selected = _new_outputs(rows, n, ranking.top_k)
    for t in numba.prange(n_threads):
        scratch = new_scratch(nodes.shape[0], graph.n_chunks)
        for r in range(t, rows, n_threads):
            q = queries[r].astype(np.float64)
            for u in range(nodes.shape[0]):
                v = _dot64(q, nodes, u)
                if v >= threshold:
                    _insert_seed(v, u, seed_ids[r], seed_sims[r])
            out = (out_chunks[r], out_scores[r])
            out_selected[r] = rank_query(
                np.int32(r + 1), seed_ids[r], queries[r], nodes, graph, ranking.hops, scratch, out
            )
    return seed_ids, seed_sims, out_chunks, out_scores, out_selected


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def rounding_norms(queries, rounded):
    """float64 norms |q|, |q~| and |q - q~| per row, q~ = ``rounded``, the bf16 rounding of q (as float32):
    the query side of ``qcg_gpu.retrieval.bounds.bound_from_norms``."""
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


@numba.njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def quantize_int8(x, scale, code_max):
    """Rows of ``x`` times their ``scale``, rounded to int8 codes (|codes| <= ``code_max`` by the
    caller's scale; clamped against rounding up), and the float64 norms |x|, |x^| and |x - x^| per
    row, x^ = codes / scale: these rows' side of ``qcg_gpu.retrieval.bounds.bound_from_norms``."""
    rows, dim = x.shape
    limit = np.float64(code_max)
    out = np.empty((rows, dim), dtype=np.int8)
    x_norm, rounded_norm, residual_norm = np.empty(rows), np.empty(rows), np.empty(rows)
    for r in numba.prange(rows):
        s = np.float64(scale[r])
        xx = rr = dd = 0.0
        for d in range(dim):
            v = np.float64(x[r, d])
            k = min(max(np.rint(v * s), -limit), limit)
            out[r, d] = np.int8(k)
            w = k / s
            xx += v * v
            rr += w * w
            dd += (v - w) * (v - w)
        x_norm[r], rounded_norm[r], residual_norm[r] = np.sqrt(xx), np.sqrt(rr), np.sqrt(dd)
    return out, x_norm, rounded_norm, residual_norm
